//! Storage-side preconditions (SPEC §10): fencing with no timing bound.
//!
//! On a route with `preconditions = "etag"`, every write that changes what a
//! key holds reaches the storage with an HTTP precondition (RFC 9110 §13):
//! the client's own `If-Match` or `If-None-Match`, passed on unchanged, or
//! one this module chooses from the key's state as the storage's own answers
//! showed it (`If-Match: <etag>` for a key that held that entity tag,
//! `If-None-Match: *` for a key that held nothing). A write for whose key no
//! state is known, and that carries none, is refused (`428
//! precondition-required`).
//!
//! # Why a late write of an old term is refused
//!
//! A state is only ever learned from an answer the storage gave, so the
//! state a write names is one the key held before the write left fencegate,
//! and so before any write of a later term left it (fencegate admits a
//! later term's writes only after it has admitted its last write of the
//! earlier term). Once a later term's write is applied, the key's state
//! changes to one it never held before, unless the key *returns* to an
//! earlier state: an entity tag that names the content (S3: the MD5 of the
//! bytes) comes back when the same bytes are written again, and a key
//! deleted again is absent again. Short of that, a write of the earlier
//! term that arrives at the storage however late names a state the key no
//! longer holds, and the storage refuses it.
//!
//! # What is remembered, and for how long
//!
//! [`KeyStates`] keeps the newest state seen for each key, for at most
//! `capacity` keys, in two generations: a key seen (or used) recently stays;
//! when the young generation is full the old one is dropped whole. A key
//! forgotten costs its next writer one read or one 428, never a wrong
//! answer. A refused write, an answer that names no state, or an unknown
//! outcome forgets the key (only if its state is still the one the write
//! named, so a newer state learned meanwhile stays). A member that takes
//! over a lease's primacy starts knowing nothing ([`KeyStates::take_over`]):
//! a state remembered from an earlier primacy may have changed since, and
//! naming an older state widens what a key that returns to it lets through.
//!
//! Nothing here allocates for a write but the key's own entry: the plan
//! hands back the remembered entity tag as a [`Bytes`] (a reference count,
//! no copy), and a lookup takes the key as `&str`.

use std::collections::HashMap;

use bytes::Bytes;

use crate::mutant::{planted, Mutant};

/// A key's state as an answer of the storage showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// The key held nothing: a 404 to a read, a delete that succeeded.
    Absent,
    /// The key held a representation with this strong entity tag (quotes
    /// included, as the storage sent it).
    Tagged(Bytes),
}

/// What a write on a precondition route does to its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteShape {
    /// It changes what the key holds: it carries a precondition.
    Key,
    /// It leaves the key's content and entity tag as they are, or stages
    /// data the key shows only once a later write makes it visible. S3's
    /// `CreateMultipartUpload` (`?uploads`), `UploadPart` and
    /// `UploadPartCopy` (`?partNumber=…&uploadId=…`),
    /// `AbortMultipartUpload` (`DELETE ?uploadId=…`) and its sub-resources
    /// (`?tagging`, `?acl`, `?retention`, `?legal-hold`, `?restore`,
    /// `?select`); Azure's `Put Block` (`?comp=block`). Storages evaluate
    /// no precondition on these: they go as they are and teach nothing.
    Aside,
}

/// The shape of a write of `method` (`DELETE`, `PUT`, …) with `query` (the
/// request's query string, without `?`). A write this does not recognise
/// is a [`WriteShape::Key`] write: it gets a precondition.
pub fn write_shape(method: &str, query: Option<&str>) -> WriteShape {
    let Some(query) = query else {
        return WriteShape::Key;
    };
    let mut upload_id = false;
    let mut part_number = false;
    for param in query.split('&') {
        let (name, value) = param.split_once('=').unwrap_or((param, ""));
        match name {
            "uploads" | "tagging" | "acl" | "retention" | "legal-hold" | "restore" | "select" => {
                return WriteShape::Aside
            }
            "comp" if value == "block" => return WriteShape::Aside,
            "uploadId" => upload_id = true,
            "partNumber" => part_number = true,
            _ => {}
        }
    }
    if upload_id && (part_number || method == "DELETE") {
        // UploadPart, UploadPartCopy, AbortMultipartUpload; the POST that
        // completes the upload (and makes it visible) is a key write.
        return WriteShape::Aside;
    }
    WriteShape::Key
}

/// What the shell does with a write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Forward it as it is: it carries the client's own precondition, or it
    /// is an [`WriteShape::Aside`] write.
    AsSent,
    /// Forward it with `If-Match: <tag>` added.
    IfMatch(Bytes),
    /// Forward it with `If-None-Match: *` added.
    IfNoneMatchAny,
    /// Refuse it (`428 precondition-required`): it carries no precondition
    /// and none can be added. With the state fencegate knows, where it
    /// knows one but may not add it (the request's signature covers the
    /// precondition headers): the client can send it itself.
    Required(Option<KeyState>),
}

/// What an exchange was, so its answer can be learned from
/// ([`KeyStates::learn`]), and the term of primacy it began in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    kind: Kind,
    epoch: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// Teaches nothing.
    Nothing,
    /// A `GET` or `HEAD` of the key itself.
    Read,
    /// A key write; `sent`: the state its added precondition named (`None`:
    /// it went with the client's own).
    Write {
        delete: bool,
        sent: Option<KeyState>,
    },
}

/// Query parameters that make a read answer for something other than the
/// key's current representation, compared without regard to case: another
/// version (S3's `versionId`, Azure's `versionid` and `snapshot`, GCS's
/// `generation`), a part, or a sub-resource (Azure's `comp` and `restype`,
/// S3's `tagging`, `acl`, `attributes`, ...). A read with any of them
/// teaches nothing; other parameters (a SAS token, `response-*` overrides,
/// `x-id`) leave it a read of the key.
const NOT_THE_KEY: [&str; 14] = [
    "versionid",
    "snapshot",
    "generation",
    "partnumber",
    "uploadid",
    "uploads",
    "comp",
    "restype",
    "tagging",
    "acl",
    "attributes",
    "torrent",
    "retention",
    "legal-hold",
];

/// Whether a `GET` or `HEAD` (`get_or_head`) with `query` reads the key's
/// current representation: not when its query names another version or a
/// sub-resource ([`NOT_THE_KEY`]), whose entity tag is not the key's.
pub fn reads_the_key(get_or_head: bool, query: Option<&str>) -> bool {
    let other = query.is_some_and(|q| {
        q.split('&').any(|param| {
            let name = param.split_once('=').map_or(param, |(n, _)| n);
            NOT_THE_KEY.iter().any(|n| n.eq_ignore_ascii_case(name))
        })
    });
    get_or_head && !other
}

impl Exchange {
    /// Whether its answer can teach anything.
    pub fn teaches(&self) -> bool {
        self.kind != Kind::Nothing
    }
}

/// How the storage answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer<'a> {
    /// It answered `status`, with `etag`: its `ETag` header, if it sent
    /// exactly one.
    Storage { status: u16, etag: Option<&'a [u8]> },
    /// fencegate stopped waiting (a lost connection, a timeout): the write
    /// may or may not be applied, now or later.
    Unknown,
}

/// The strong entity tag `value` names, if it is one: `"…"` with no `"`
/// inside (RFC 9110 §8.8.3). A weak one (`W/"…"`) names no state a write
/// can be conditioned on: `If-Match` compares strongly, so it never matches.
pub fn strong_tag(value: &[u8]) -> Option<&[u8]> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let etagc = |b: &u8| *b == 0x21 || (0x23..=0x7e).contains(b) || *b >= 0x80;
    inner.iter().all(etagc).then_some(value)
}

/// The newest state seen of each key, for at most `capacity` keys.
#[derive(Debug)]
pub struct KeyStates {
    /// Keys seen or used since the last rotation.
    young: HashMap<Box<str>, KeyState>,
    /// Keys of the generation before; one used again moves to `young`.
    old: HashMap<Box<str>, KeyState>,
    /// The most keys a generation holds: half the capacity.
    generation: usize,
    /// Counts the terms of primacy this table served ([`Self::take_over`]):
    /// an answer to an exchange of an earlier one teaches nothing.
    epoch: u64,
}

impl KeyStates {
    /// A table of at most `capacity` keys (at least two).
    pub fn new(capacity: usize) -> Self {
        Self {
            young: HashMap::new(),
            old: HashMap::new(),
            generation: (capacity / 2).max(1),
            epoch: 0,
        }
    }

    fn exchange(&self, kind: Kind) -> Exchange {
        Exchange {
            kind,
            epoch: self.epoch,
        }
    }

    /// A read of a key on a route with preconditions: a `GET` or `HEAD`
    /// (`get_or_head`) with `query` (see [`reads_the_key`]).
    pub fn read(&self, get_or_head: bool, query: Option<&str>) -> Exchange {
        if reads_the_key(get_or_head, query) {
            self.exchange(Kind::Read)
        } else {
            self.exchange(Kind::Nothing)
        }
    }

    /// How many keys it remembers.
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    /// Whether it remembers no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it remembers.
    pub fn capacity(&self) -> usize {
        self.generation * 2
    }

    /// The state remembered for `key`, without marking it used.
    pub fn known(&self, key: &str) -> Option<&KeyState> {
        self.young.get(key).or_else(|| self.old.get(key))
    }

    /// What to do with a write to `key` of `shape` (`delete`: a `DELETE`);
    /// `own`: it carries its own `If-Match` or `If-None-Match`;
    /// `may_add`: a precondition may be added to it (not when its signature
    /// covers the precondition headers, as Azure's Shared Key does). With
    /// the exchange to learn its answer from.
    pub fn plan_write(
        &mut self,
        key: &str,
        shape: WriteShape,
        delete: bool,
        own: bool,
        may_add: bool,
    ) -> (Plan, Exchange) {
        if shape == WriteShape::Aside {
            return (Plan::AsSent, self.exchange(Kind::Nothing));
        }
        if own {
            let exchange = self.exchange(Kind::Write { delete, sent: None });
            return (Plan::AsSent, exchange);
        }
        let known = self.touch(key).cloned();
        if planted(Mutant::PreconditionDropped) && known.is_some() {
            let exchange = self.exchange(Kind::Write {
                delete,
                sent: known,
            });
            return (Plan::AsSent, exchange);
        }
        let plan = match &known {
            Some(_) if !may_add => {
                return (Plan::Required(known), self.exchange(Kind::Nothing));
            }
            None => return (Plan::Required(None), self.exchange(Kind::Nothing)),
            Some(KeyState::Absent) => Plan::IfNoneMatchAny,
            Some(KeyState::Tagged(tag)) => Plan::IfMatch(tag.clone()),
        };
        (
            plan,
            self.exchange(Kind::Write {
                delete,
                sent: known,
            }),
        )
    }

    /// Learns what `answer` to `exchange` (an exchange about `key`) shows;
    /// nothing, if the exchange began in an earlier term of primacy.
    ///
    /// - A read answered 2xx or 304 shows the entity tag it carries (or, if
    ///   it carries no strong one, a state that cannot be named: the key is
    ///   forgotten); a 404 or 410 shows the key absent; anything else shows
    ///   nothing.
    /// - A key write answered 2xx was applied: a `DELETE` leaves the key
    ///   absent, any other write leaves it with the entity tag of the
    ///   answer (none: forgotten). A `DELETE` answered 404 found it absent.
    /// - A key write refused (any other status) changed nothing the answer
    ///   names, and one whose outcome is unknown may still change the key:
    ///   the key is forgotten, if its state is still the one the write's
    ///   added precondition named (a write with the client's own: always).
    pub fn learn(&mut self, key: &str, exchange: &Exchange, answer: Answer<'_>) {
        let kept_across_takeover = planted(Mutant::StatesKeptAcrossTakeover);
        if exchange.epoch != self.epoch && !kept_across_takeover {
            return;
        }
        match (&exchange.kind, answer) {
            (Kind::Nothing, _) | (Kind::Read, Answer::Unknown) => {}
            (Kind::Read, Answer::Storage { status, etag }) => match status {
                200..=299 | 304 => self.tagged(key, etag),
                404 | 410 => self.set(key, KeyState::Absent),
                _ => {}
            },
            (Kind::Write { delete, sent }, answer) => {
                let applied = match answer {
                    Answer::Storage { status, .. } => (200..=299).contains(&status),
                    Answer::Unknown => false,
                };
                let refused_taken_as_applied =
                    planted(Mutant::RefusedWriteTeaches) && answer != Answer::Unknown;
                match answer {
                    Answer::Storage { status: 404, .. } if *delete => {
                        self.set(key, KeyState::Absent);
                    }
                    _ if (applied || refused_taken_as_applied) && *delete => {
                        self.set(key, KeyState::Absent)
                    }
                    Answer::Storage { etag, .. } if applied || refused_taken_as_applied => {
                        self.tagged(key, etag)
                    }
                    _ => match sent {
                        Some(sent) => self.forget_if(key, sent),
                        None => self.forget(key),
                    },
                }
            }
        }
    }

    /// A member took over the primacy this table serves: it starts knowing
    /// nothing, and answers to the exchanges of its earlier terms of
    /// primacy teach nothing either.
    pub fn take_over(&mut self) {
        self.epoch += 1;
        if planted(Mutant::StatesKeptAcrossTakeover) {
            return;
        }
        self.young = HashMap::new();
        self.old = HashMap::new();
    }

    /// Forgets `key`.
    pub fn forget(&mut self, key: &str) {
        self.young.remove(key);
        self.old.remove(key);
    }

    /// Forgets `key` if its state is still `state`.
    fn forget_if(&mut self, key: &str, state: &KeyState) {
        if self.known(key) == Some(state) {
            self.forget(key);
        }
    }

    /// Remembers the state an `ETag` header shows, or forgets the key if it
    /// names none.
    fn tagged(&mut self, key: &str, etag: Option<&[u8]>) {
        match etag.and_then(strong_tag) {
            Some(tag) => {
                if let Some(KeyState::Tagged(known)) = self.touch(key) {
                    if known.as_ref() == tag {
                        return;
                    }
                }
                // An owned buffer behind a reference count: handing it to a
                // request (`Plan::IfMatch`) clones the count, copies nothing.
                let tag = Bytes::from_owner(Box::<[u8]>::from(tag));
                self.set(key, KeyState::Tagged(tag));
            }
            None => self.forget(key),
        }
    }

    /// The state of `key`, moved to the young generation if it was old.
    fn touch(&mut self, key: &str) -> Option<&KeyState> {
        if !self.young.contains_key(key) {
            let (key, state) = self.old.remove_entry(key)?;
            self.insert(key, state);
        }
        self.young.get(key)
    }

    /// Remembers `state` for `key`.
    fn set(&mut self, key: &str, state: KeyState) {
        if let Some(known) = self.young.get_mut(key) {
            *known = state;
            return;
        }
        // A key of the old generation keeps its allocation.
        let key = match self.old.remove_entry(key) {
            Some((key, _)) => key,
            None => Box::from(key),
        };
        self.insert(key, state);
    }

    /// Adds an entry to the young generation; a full young generation
    /// becomes the old one, and the old one is dropped.
    fn insert(&mut self, key: Box<str>, state: KeyState) {
        if self.young.len() >= self.generation {
            std::mem::swap(&mut self.young, &mut self.old);
            // Keeps the table's allocation for the next generation.
            self.young.clear();
        }
        self.young.insert(key, state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &[u8] = b"\"a\"";
    const B: &[u8] = b"\"b\"";

    fn tag(t: &[u8]) -> KeyState {
        KeyState::Tagged(Bytes::copy_from_slice(t))
    }

    fn ok(status: u16, etag: Option<&[u8]>) -> Answer<'_> {
        Answer::Storage { status, etag }
    }

    /// A `GET` of the key, as `states` would plan it.
    fn read(states: &KeyStates) -> Exchange {
        states.read(true, None)
    }

    fn put(s: &mut KeyStates, key: &str) -> (Plan, Exchange) {
        s.plan_write(key, WriteShape::Key, false, false, true)
    }

    #[test]
    fn an_unknown_key_is_refused_until_read() {
        let mut s = KeyStates::new(16);
        assert_eq!(put(&mut s, "/k").0, Plan::Required(None));
        s.learn("/k", &read(&s), ok(404, None));
        assert_eq!(put(&mut s, "/k").0, Plan::IfNoneMatchAny);
        s.learn("/k", &read(&s), ok(200, Some(A)));
        assert_eq!(put(&mut s, "/k").0, Plan::IfMatch(Bytes::from_static(A)));
    }

    #[test]
    fn writes_teach_the_state_they_leave() {
        let mut s = KeyStates::new(16);
        s.learn("/k", &read(&s), ok(404, None));
        let (plan, ex) = put(&mut s, "/k");
        assert_eq!(plan, Plan::IfNoneMatchAny);
        s.learn("/k", &ex, ok(201, Some(A)));
        assert_eq!(s.known("/k"), Some(&tag(A)));
        let (plan, ex) = s.plan_write("/k", WriteShape::Key, true, false, true);
        assert_eq!(plan, Plan::IfMatch(Bytes::from_static(A)));
        s.learn("/k", &ex, ok(204, None));
        assert_eq!(s.known("/k"), Some(&KeyState::Absent));
        // An applied write whose answer names no state: forgotten.
        let (_, ex) = put(&mut s, "/k");
        s.learn("/k", &ex, ok(200, None));
        assert_eq!(s.known("/k"), None);
        // A weak tag names nothing a write can be conditioned on.
        s.learn("/k", &read(&s), ok(200, Some(b"W/\"a\"")));
        assert_eq!(s.known("/k"), None);
        // A delete that found nothing leaves it absent.
        let (_, ex) = s.plan_write("/k", WriteShape::Key, true, true, true);
        s.learn("/k", &ex, ok(404, None));
        assert_eq!(s.known("/k"), Some(&KeyState::Absent));
    }

    #[test]
    fn refusals_and_unknown_outcomes_forget_the_state_they_named() {
        for answer in [ok(412, None), ok(409, None), ok(500, None), Answer::Unknown] {
            let mut s = KeyStates::new(16);
            s.learn("/k", &read(&s), ok(200, Some(A)));
            let (_, ex) = put(&mut s, "/k");
            s.learn("/k", &ex, answer);
            assert_eq!(s.known("/k"), None, "{answer:?}");
            // One named a state since replaced: the newer one stays.
            s.learn("/k", &read(&s), ok(200, Some(A)));
            let (_, first) = put(&mut s, "/k");
            let (_, second) = put(&mut s, "/k");
            s.learn("/k", &second, ok(200, Some(B)));
            s.learn("/k", &first, answer);
            assert_eq!(s.known("/k"), Some(&tag(B)), "{answer:?}");
        }
    }

    #[test]
    fn own_preconditions_and_aside_writes_go_as_sent() {
        let mut s = KeyStates::new(16);
        let (plan, ex) = s.plan_write("/k", WriteShape::Key, false, true, true);
        assert_eq!(plan, Plan::AsSent);
        s.learn("/k", &ex, ok(200, Some(A)));
        assert_eq!(s.known("/k"), Some(&tag(A)));
        let (plan, ex) = s.plan_write("/k", WriteShape::Key, false, true, true);
        assert_eq!(plan, Plan::AsSent);
        s.learn("/k", &ex, ok(412, None));
        assert_eq!(s.known("/k"), None);
        s.learn("/k", &read(&s), ok(200, Some(A)));
        let (plan, ex) = s.plan_write("/k", WriteShape::Aside, false, false, true);
        assert_eq!((plan, ex.teaches()), (Plan::AsSent, false));
        // A part's answer carries the part's tag, not the key's.
        s.learn("/k", &ex, ok(200, Some(B)));
        assert_eq!(s.known("/k"), Some(&tag(A)));
    }

    #[test]
    fn a_signature_over_the_headers_gets_the_state_to_send() {
        let mut s = KeyStates::new(16);
        s.learn("/k", &read(&s), ok(200, Some(A)));
        let (plan, ex) = s.plan_write("/k", WriteShape::Key, false, false, false);
        assert_eq!(plan, Plan::Required(Some(tag(A))));
        assert!(!ex.teaches());
    }

    #[test]
    fn reads_of_other_versions_teach_nothing() {
        for query in [
            "versionId=1",
            "snapshot=2026-01-01",
            "comp=metadata",
            "x=1&versionid=2",
        ] {
            assert!(!reads_the_key(true, Some(query)), "{query}");
        }
        for query in [
            "sv=2021-08-06&sig=abc",
            "x-id=GetObject",
            "response-content-type=a",
        ] {
            assert!(reads_the_key(true, Some(query)), "{query}");
        }
        assert!(!reads_the_key(false, None));
        let mut s = KeyStates::new(16);
        s.learn("/k", &read(&s), ok(403, Some(A)));
        s.learn("/k", &read(&s), ok(500, None));
        assert_eq!(s.known("/k"), None);
    }

    #[test]
    fn shapes() {
        use WriteShape::{Aside, Key};
        for (method, query, shape) in [
            ("PUT", None, Key),
            ("DELETE", None, Key),
            ("POST", Some("uploads"), Aside),
            ("PUT", Some("partNumber=1&uploadId=x"), Aside),
            ("PUT", Some("uploadId=x&partNumber=2"), Aside),
            ("POST", Some("uploadId=x"), Key),
            ("DELETE", Some("uploadId=x"), Aside),
            ("PUT", Some("tagging"), Aside),
            ("PUT", Some("acl="), Aside),
            ("PUT", Some("comp=block&blockid=YQ"), Aside),
            ("PUT", Some("comp=blocklist"), Key),
            ("PUT", Some("comp=metadata"), Key),
            ("PUT", Some("x-id=PutObject"), Key),
        ] {
            assert_eq!(write_shape(method, query), shape, "{method} {query:?}");
        }
    }

    #[test]
    fn strong_tags() {
        assert_eq!(strong_tag(b"\"abc\""), Some(&b"\"abc\""[..]));
        assert_eq!(strong_tag(b"\"\""), Some(&b"\"\""[..]));
        for bad in [
            &b"W/\"a\""[..],
            b"abc",
            b"\"a",
            b"\"a\"b\"",
            b"\"",
            b"\"a b\"",
        ] {
            assert_eq!(strong_tag(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn memory_is_bounded_and_recent_keys_stay() {
        let mut s = KeyStates::new(100);
        s.learn("/hot", &read(&s), ok(200, Some(A)));
        for i in 0..10_000 {
            let key = format!("/k{i}");
            s.learn(&key, &read(&s), ok(404, None));
            assert!(s.len() <= s.capacity());
            if i % 10 == 0 {
                assert_eq!(put(&mut s, "/hot").0, Plan::IfMatch(Bytes::from_static(A)));
            }
        }
        assert_eq!(s.capacity(), 100);
        assert!(s.known("/k9999").is_some());
        assert!(s.known("/k0").is_none());
        s.take_over();
        assert!(s.is_empty());
    }

    #[test]
    fn a_new_primacy_learns_nothing_from_the_old_one() {
        let mut s = KeyStates::new(16);
        let before = read(&s);
        let (_, write) = s.plan_write("/w", WriteShape::Key, false, true, true);
        s.take_over();
        s.learn("/k", &before, ok(200, Some(A)));
        s.learn("/w", &write, ok(200, Some(B)));
        assert!(s.is_empty());
        s.learn("/k", &read(&s), ok(200, Some(A)));
        assert_eq!(s.known("/k"), Some(&tag(A)));
    }
}
