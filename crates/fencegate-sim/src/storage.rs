//! The simulated storage of the routes with preconditions (SPEC §10): keys
//! whose states carry entity tags of one of two kinds, preconditions
//! evaluated when a write is applied, and the key's history, from which the
//! checker tells what the guarantee allows.
//!
//! Two kinds of entity tag:
//! - [`TagKind::Version`] (Azure Blob, the embedded store): every applied
//!   write gets a tag never seen before. A key can return to an earlier
//!   state only by being deleted again: absent is absent.
//! - [`TagKind::Content`] (S3, whose ETag is the MD5 of the bytes): the tag
//!   names the content, so a key written with bytes it held before has its
//!   earlier tag again.
//!
//! What the checker allows, exactly: a write of term `t` applied to a key
//! after a write of a later term was applied to it is a violation, unless
//! the precondition it carried names a state the key held before that
//! later write was applied (and holds again now, or the write would have
//! been refused): the key *returned* to it. With version tags that state is
//! "absent" (the key deleted again); with content tags it is also any
//! content the key held before. Writes with no precondition never pass.
//!
//! The storage reads each request as S3 does ([`s3_operation`]): a
//! sub-resource of another method is that method's key write (`PUT
//! ?uploads` is a PutObject, `DELETE ?acl` a DeleteObject, `POST
//! ?uploadId&partNumber` a CompleteMultipartUpload), the query's names are
//! percent-decoded, and each operation evaluates only its own
//! preconditions: a DELETE compares `If-Match` and ignores
//! `If-None-Match`, a write compares `If-None-Match` only as `*`, an empty
//! `If-Match` is ignored and `If-Match: *` matches any representation (as
//! moto 5.2.6 was seen to do). A request fencegate lets through with a
//! precondition the storage does not evaluate is then a write with none,
//! and the checker finds it when it lands late. The clients send the
//! request shapes of [`PUTS`], [`DELETES`] and [`READS`].

use std::collections::BTreeMap;

/// How a storage names a key's states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagKind {
    /// A new tag for every write.
    Version,
    /// The tag names the content.
    Content,
}

/// A key's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Absent,
    /// A representation with this tag.
    Tagged(u64),
}

impl State {
    /// The entity tag an answer carries for it, quotes included.
    pub fn etag(self) -> Option<String> {
        match self {
            State::Absent => None,
            State::Tagged(n) => Some(format!("\"{n}\"")),
        }
    }

    /// The state an entity tag this storage gave names.
    pub fn from_etag(tag: &[u8]) -> Option<State> {
        let inner = tag.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        std::str::from_utf8(inner)
            .ok()?
            .parse()
            .ok()
            .map(State::Tagged)
    }
}

/// A violation of the guarantee: the storage applied a write of an earlier
/// term after one of a later term, though the write's precondition named
/// no state the key held before that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleApplied {
    pub key: String,
    pub token: u64,
    pub later_token: u64,
    /// The request as it reached the storage: its method and query.
    pub method: &'static str,
    pub query: Option<&'static str>,
    /// What the storage evaluated of its preconditions.
    pub conditions: [Condition; 2],
}

impl std::fmt::Display for StaleApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the storage applied a write of term {} to key {} after one of term {}, though its \
             preconditions ({:?}, as {} {:?} evaluates them) named no state the key held before that",
            self.token,
            self.key,
            self.later_token,
            self.conditions,
            self.method,
            self.query.unwrap_or("")
        )
    }
}

/// A request a client sends on a route with preconditions: its method,
/// its query, and the precondition headers it carries itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub method: &'static str,
    pub query: Option<&'static str>,
    pub if_match: Option<&'static str>,
    pub if_none_match: Option<&'static str>,
}

const fn shape(method: &'static str, query: Option<&'static str>) -> Shape {
    Shape {
        method,
        query,
        if_match: None,
        if_none_match: None,
    }
}

const fn own(
    method: &'static str,
    if_match: Option<&'static str>,
    if_none_match: Option<&'static str>,
) -> Shape {
    Shape {
        method,
        query: None,
        if_match,
        if_none_match,
    }
}

/// The writes of a client that writes a key: the plain PUT first (most
/// writes), then shapes that once let a late write through: sub-resources
/// of other methods, an upload's completion with a stray parameter,
/// preconditions that protect nothing, and some that are what they seem.
pub const PUTS: [Shape; 10] = [
    shape("PUT", None),
    shape("PUT", Some("uploads")),
    shape("PUT", Some("x-id=PutObject")),
    shape("POST", Some("uploadId=U&partNumber=1")),
    shape("PUT", Some("tagging")),
    shape("PUT", Some("%74agging")),
    own("PUT", None, Some("\"x\"")),
    own("PUT", Some(""), None),
    own("PUT", Some("*"), None),
    own("PUT", None, Some("*")),
];

/// The deletes: the plain DELETE first, then as [`PUTS`].
pub const DELETES: [Shape; 7] = [
    shape("DELETE", None),
    shape("DELETE", Some("acl")),
    shape("DELETE", Some("uploads")),
    shape("DELETE", Some("x-id=DeleteObject")),
    shape("DELETE", Some("tagging")),
    own("DELETE", Some("*"), None),
    own("DELETE", None, Some("*")),
];

/// The reads: a plain `GET` first, then reads of other versions (which S3
/// answers 404 whatever the key holds: `NoSuchVersion` in a `GET`'s body,
/// nothing in a `HEAD`'s), and reads of the key with a neutral parameter.
pub const READS: [Shape; 6] = [
    shape("GET", None),
    shape("HEAD", None),
    shape("GET", Some("versionId=v1")),
    shape("HEAD", Some("version%49d=v1")),
    shape("GET", Some("x-id=GetObject")),
    shape("HEAD", Some("versionid=v1")),
];

/// A precondition header as the storage reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// `"n"`: one of this storage's tags.
    Tag(u64),
    /// `*`.
    Any,
    /// Empty.
    Empty,
    /// Anything else (a tag the storage never gave).
    Other,
}

impl Header {
    pub fn parse(value: &[u8]) -> Header {
        match value {
            b"*" => Header::Any,
            b"" => Header::Empty,
            tag => match State::from_etag(tag) {
                Some(State::Tagged(n)) => Header::Tag(n),
                _ => Header::Other,
            },
        }
    }
}

/// What S3 does with a request on a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum S3Op {
    /// PutObject (or CopyObject): sets the content.
    Put,
    /// CompleteMultipartUpload: sets the content.
    Complete,
    /// DeleteObject.
    Delete,
    /// Tagging, ACLs, parts, an upload's start or abort: the key's content
    /// and tag stay as they are.
    Aside,
}

/// `raw` percent-decoded, as S3 (and moto, through Python's `unquote`)
/// decode a query's names.
fn unquote(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The operation S3 executes for `method` with `query`, by its decoded
/// parameter names, as moto dispatches it.
pub fn s3_operation(method: &str, query: Option<&str>) -> S3Op {
    let names: Vec<String> = query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| unquote(p.split_once('=').map_or(p, |(n, _)| n)))
        .collect();
    let has = |n: &str| names.iter().any(|m| m == n);
    match method {
        "PUT" if has("uploadId") && has("partNumber") => S3Op::Aside,
        "PUT"
            if ["retention", "legal-hold", "acl", "tagging"]
                .iter()
                .any(|n| has(n)) =>
        {
            S3Op::Aside
        }
        "PUT" => S3Op::Put,
        "DELETE" if has("uploadId") || has("tagging") => S3Op::Aside,
        "DELETE" => S3Op::Delete,
        "POST" if has("uploads") => S3Op::Aside,
        "POST" if has("uploadId") => S3Op::Complete,
        _ => S3Op::Aside,
    }
}

/// What a request's preconditions, as the storage evaluates them, ask of
/// the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// Nothing: the write goes whatever the key holds.
    None,
    /// The key holds this state.
    Is(State),
    /// The key holds some representation (`If-Match: *`).
    Exists,
    /// Never true (a tag the storage never gave).
    Never,
}

impl Condition {
    fn holds(self, current: State) -> bool {
        match self {
            Condition::None => true,
            Condition::Is(state) => state == current,
            Condition::Exists => current != State::Absent,
            Condition::Never => false,
        }
    }
}

/// The conditions S3 evaluates for `op` with these headers: `If-Match` on
/// every key write (an empty one ignored); `If-None-Match` on a write, and
/// only as `*`; nothing else.
pub fn evaluated(
    op: S3Op,
    if_match: Option<Header>,
    if_none_match: Option<Header>,
) -> [Condition; 2] {
    let matched = match if_match {
        Some(Header::Tag(n)) => Condition::Is(State::Tagged(n)),
        Some(Header::Any) => Condition::Exists,
        Some(Header::Other) => Condition::Never,
        Some(Header::Empty) | None => Condition::None,
    };
    let none_matched = match (op, if_none_match) {
        (S3Op::Put | S3Op::Complete, Some(Header::Any)) => Condition::Is(State::Absent),
        _ => Condition::None,
    };
    match op {
        S3Op::Aside => [Condition::None; 2],
        _ => [matched, none_matched],
    }
}

/// How S3 answers a read of `shape` while the key holds `state`: its
/// status, the state its `ETag` names, and the error code in its body.
pub fn read_answer(shape: Shape, state: State) -> (u16, Option<State>, Option<&'static str>) {
    let names = shape.query.map(unquote).unwrap_or_default();
    let version = names
        .split('&')
        .any(|p| p.split_once('=').map_or(p, |(n, _)| n) == "versionId");
    let head = shape.method == "HEAD";
    match (version, state) {
        // No such version: a GET's body says so, a HEAD's 404 has no body.
        (true, _) => (404, None, (!head).then_some("NoSuchVersion")),
        (false, State::Absent) => (404, None, (!head).then_some("NoSuchKey")),
        (false, tagged) => (200, Some(tagged), None),
    }
}

/// A write as the storage applies it.
#[derive(Clone, Copy, Debug)]
pub struct KeyWrite {
    pub token: u64,
    /// The request as it reaches the storage (method and query).
    pub shape: Shape,
    /// Its precondition headers as they reach the storage (its own, or the
    /// one fencegate added).
    pub if_match: Option<Header>,
    pub if_none_match: Option<Header>,
    /// The bytes a PUT writes (one of a few values, so contents repeat).
    pub content: u64,
}

/// What the storage did with a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Applied: the key's state is now this one.
    Applied(State),
    /// Its precondition did not hold: nothing changed.
    Refused,
    /// Executed as an operation that leaves the key as it was.
    Untouched,
}

/// One applied write: when, its token, the state it left.
#[derive(Clone, Copy, Debug)]
struct Applied {
    at: u64,
    token: u64,
    state: State,
}

/// A key's history: it is absent until the first write applied to it.
#[derive(Debug, Default)]
struct Key {
    applied: Vec<Applied>,
}

impl Key {
    fn state(&self) -> State {
        self.applied.last().map_or(State::Absent, |a| a.state)
    }

    /// The state just before `at` (before anything applied at `at`).
    fn state_before(&self, at: u64) -> State {
        self.applied
            .iter()
            .take_while(|a| a.at < at)
            .last()
            .map_or(State::Absent, |a| a.state)
    }

    /// Whether the key held `state` at some moment in `[from, to]`.
    fn held_between(&self, state: State, from: u64, to: u64) -> bool {
        self.state_before(from) == state
            || self
                .applied
                .iter()
                .any(|a| a.at >= from && a.at <= to && a.state == state)
    }

    /// Whether the key held `state` before its `i`-th applied write.
    fn held_before(&self, state: State, i: usize) -> bool {
        state == State::Absent || self.applied[..i].iter().any(|a| a.state == state)
    }
}

/// The keys of the routes with preconditions.
#[derive(Debug)]
pub struct Keys {
    kind: TagKind,
    next_version: u64,
    keys: BTreeMap<String, Key>,
    /// Stale writes the storage applied because their key returned to the
    /// state they named: the documented bound, counted.
    pub returns: u64,
    /// Stale writes its preconditions refused.
    pub refused_stale: u64,
}

impl Keys {
    pub fn new(kind: TagKind) -> Self {
        Self {
            kind,
            next_version: 0,
            keys: BTreeMap::new(),
            returns: 0,
            refused_stale: 0,
        }
    }

    fn key(&mut self, name: &str) -> &mut Key {
        self.keys.entry(name.to_owned()).or_default()
    }

    /// The key's state now.
    pub fn state(&self, name: &str) -> State {
        self.keys.get(name).map_or(State::Absent, Key::state)
    }

    /// Whether the key held `state` at some moment in `[from, to]`.
    pub fn held_between(&self, name: &str, state: State, from: u64, to: u64) -> bool {
        match self.keys.get(name) {
            Some(key) => key.held_between(state, from, to),
            None => state == State::Absent,
        }
    }

    /// Applies `write` to `name` at `now` as S3 executes it, if the
    /// preconditions it evaluates hold; checks the guarantee (see the module
    /// docs): `Err` is a violation.
    pub fn apply(
        &mut self,
        name: &str,
        now: u64,
        write: KeyWrite,
    ) -> Result<Outcome, StaleApplied> {
        let op = s3_operation(write.shape.method, write.shape.query);
        if op == S3Op::Aside {
            return Ok(Outcome::Untouched);
        }
        let kind = self.kind;
        let current = self.state(name);
        // The first write of a later term the key took.
        let later = self.keys.get(name).and_then(|k| {
            k.applied
                .iter()
                .position(|a| a.token > write.token)
                .map(|i| (i, k.applied[i].token))
        });
        let conditions = evaluated(op, write.if_match, write.if_none_match);
        if !conditions.iter().all(|c| c.holds(current)) {
            if later.is_some() {
                self.refused_stale += 1;
            }
            return Ok(Outcome::Refused);
        }
        if let Some((i, later_token)) = later {
            // A state it names exactly, held before the later write (and
            // now again, or the write would have been refused).
            let returned = conditions.iter().any(|c| match c {
                Condition::Is(p) => self.keys[name].held_before(*p, i),
                _ => false,
            });
            if !returned {
                return Err(StaleApplied {
                    key: name.to_owned(),
                    token: write.token,
                    later_token,
                    method: write.shape.method,
                    query: write.shape.query,
                    conditions,
                });
            }
            self.returns += 1;
        }
        let next = if op == S3Op::Delete {
            State::Absent
        } else {
            match kind {
                TagKind::Content => State::Tagged(write.content),
                TagKind::Version => {
                    self.next_version += 1;
                    State::Tagged(1_000 + self.next_version)
                }
            }
        };
        self.key(name).applied.push(Applied {
            at: now,
            token: write.token,
            state: next,
        });
        Ok(Outcome::Applied(next))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain PUT of `content` with the storage's precondition `p`.
    fn put(token: u64, precondition: Option<State>, content: u64) -> KeyWrite {
        let (if_match, if_none_match) = match precondition {
            None => (None, None),
            Some(State::Absent) => (None, Some(Header::Any)),
            Some(State::Tagged(n)) => (Some(Header::Tag(n)), None),
        };
        KeyWrite {
            token,
            shape: PUTS[0],
            if_match,
            if_none_match,
            content,
        }
    }

    #[test]
    fn version_tags_refuse_a_late_write_of_an_old_term() {
        let mut keys = Keys::new(TagKind::Version);
        let a = keys.apply("k", 1, put(1, Some(State::Absent), 0)).unwrap();
        let Outcome::Applied(s1) = a else { panic!() };
        // B (term 2) writes on s1; A's write named s1 too and comes late.
        assert!(matches!(
            keys.apply("k", 5, put(2, Some(s1), 0)),
            Ok(Outcome::Applied(_))
        ));
        assert_eq!(
            keys.apply("k", 9, put(1, Some(s1), 0)),
            Ok(Outcome::Refused)
        );
        assert_eq!(keys.refused_stale, 1);
        // With no precondition it would land: a violation.
        assert!(keys.apply("k", 10, put(1, None, 0)).is_err());
    }

    #[test]
    fn content_tags_let_a_returned_state_through_and_nothing_else() {
        let mut keys = Keys::new(TagKind::Content);
        keys.apply("k", 1, put(1, None, 7)).unwrap();
        keys.apply("k", 2, put(2, Some(State::Tagged(7)), 8))
            .unwrap();
        keys.apply("k", 3, put(2, Some(State::Tagged(8)), 7))
            .unwrap();
        // Term 1's write named 7, which the key held before term 2 wrote
        // and holds again: the documented bound.
        assert!(keys
            .apply("k", 4, put(1, Some(State::Tagged(7)), 9))
            .is_ok());
        assert_eq!(keys.returns, 1);
        // A state first held after the later term's write: a violation.
        let mut keys = Keys::new(TagKind::Content);
        keys.apply("k", 1, put(2, Some(State::Absent), 8)).unwrap();
        keys.apply("k", 2, put(2, Some(State::Tagged(8)), 5))
            .unwrap();
        assert!(keys
            .apply("k", 3, put(1, Some(State::Tagged(5)), 9))
            .is_err());
    }

    /// What S3 evaluates, per operation: the shapes that let late writes
    /// through land as writes with no precondition.
    #[test]
    fn each_operation_evaluates_its_own_preconditions() {
        assert_eq!(s3_operation("PUT", Some("uploads")), S3Op::Put);
        assert_eq!(s3_operation("PUT", Some("%74agging")), S3Op::Aside);
        assert_eq!(s3_operation("DELETE", Some("acl")), S3Op::Delete);
        assert_eq!(
            s3_operation("POST", Some("uploadId=U&partNumber=1")),
            S3Op::Complete
        );
        assert_eq!(s3_operation("POST", Some("uploads")), S3Op::Aside);
        let none = [Condition::None; 2];
        assert_eq!(evaluated(S3Op::Delete, None, Some(Header::Any)), none);
        assert_eq!(evaluated(S3Op::Put, None, Some(Header::Other)), none);
        assert_eq!(evaluated(S3Op::Put, Some(Header::Empty), None), none);
        assert_eq!(
            evaluated(S3Op::Delete, Some(Header::Any), None),
            [Condition::Exists, Condition::None]
        );
        // A late DELETE with If-None-Match: * removes what term 2 wrote.
        let mut keys = Keys::new(TagKind::Version);
        keys.apply("k", 1, put(2, Some(State::Absent), 0)).unwrap();
        let late = KeyWrite {
            token: 1,
            shape: DELETES[0],
            if_match: None,
            if_none_match: Some(Header::Any),
            content: 0,
        };
        assert!(keys.apply("k", 2, late).is_err());
        assert_eq!(read_answer(READS[3], keys.state("k")), (404, None, None));
        assert_eq!(
            read_answer(READS[2], keys.state("k")).2,
            Some("NoSuchVersion")
        );
    }

    #[test]
    fn history_answers_what_was_held_when() {
        let mut keys = Keys::new(TagKind::Version);
        keys.apply("k", 10, put(1, None, 0)).unwrap();
        let s = keys.state("k");
        assert!(keys.held_between("k", State::Absent, 0, 10));
        // At 10 it was absent until the write applied at 10.
        assert!(keys.held_between("k", State::Absent, 10, 20));
        assert!(!keys.held_between("k", State::Absent, 11, 20));
        assert!(keys.held_between("k", s, 5, 10));
        assert!(!keys.held_between("k", s, 0, 9));
    }
}
