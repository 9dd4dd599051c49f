//! Storage-side preconditions (SPEC §10): fencing with no timing bound.
//!
//! On a route with preconditions (`"s3"`, `"azure"` or `"etag"`: the
//! storage's API, [`Dialect`]), every write the storage may
//! execute as a change to a key reaches it with an HTTP precondition (RFC
//! 9110 §13) that the storage evaluates for that operation
//! ([`Operation`]): the client's own `If-Match` or `If-None-Match`, passed
//! on unchanged where it names a state the storage will compare
//! ([`Own::protects`]), or one this module chooses from the key's state as
//! the storage's own answers showed it (`If-Match: <etag>` for a key that
//! held that entity tag, `If-None-Match: *` for a key that held nothing,
//! except on a DELETE, which no storage-independent precondition can
//! condition on absence). Any other write is refused (`428
//! precondition-required`), and the storage sees none of it.
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
//! longer holds, and the storage refuses it, provided the storage
//! evaluates that precondition on that operation: what [`request`]
//! decides, the way S3 and Azure read a request.
//!
//! # What is remembered, and for how long
//!
//! [`KeyStates`] keeps the newest state seen for each key, for at most
//! `capacity` keys: half for the keys writers used (a write planned with
//! the key's state, or one whose answer showed it), half for keys only
//! read, so reads of many keys (which need no credential) cannot push out
//! the keys of the writes in progress. Each half keeps two generations: a
//! key seen (or used) recently stays; when the young generation is full the
//! old one is dropped whole. A key forgotten costs its next writer one read
//! or one 428, never a wrong answer. A refused write, an answer that names
//! no state, or an unknown outcome forgets the key (only if its state is
//! still the one the write named, so a newer state learned meanwhile
//! stays). A member that takes over a lease's primacy starts knowing
//! nothing ([`KeyStates::take_over`]): a state remembered from an earlier
//! primacy may have changed since, and naming an older state widens what a
//! key that returns to it lets through.
//!
//! "Absent" is learned only from an answer that says the key is absent: a
//! 404 or 410 to a read of the key itself (or to its DELETE) whose error
//! code, if it has one, is the storage's "no such key" (S3's `NoSuchKey`,
//! Azure's `BlobNotFound`), not one about a version, an upload or a bucket
//! ([`says_absent`], [`error_code`]).
//!
//! Nothing here allocates for a write but the key's own entry: the plan
//! hands back the remembered entity tag as a [`Bytes`] (a reference count,
//! no copy), and a lookup takes the key as `&str`.

pub mod request;

use std::collections::HashMap;

use bytes::Bytes;

use crate::mutant::{planted, Mutant};

pub use request::{decode, reads_the_key, Classified, Dialect, Operation, Own, Sent, Unprotected};

/// A key's state as an answer of the storage showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// The key held nothing: a 404 to a read, a delete that succeeded.
    Absent,
    /// The key held a representation with this strong entity tag (quotes
    /// included, as the storage sent it).
    Tagged(Bytes),
}

/// What the shell does with a write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Forward it as it is: it carries the client's own precondition, one
    /// the storage compares, or it is an [`Operation::Aside`] write.
    AsSent,
    /// Forward it with `If-Match: <tag>` added.
    IfMatch(Bytes),
    /// Forward it with `If-None-Match: *` added.
    IfNoneMatchAny,
    /// Refuse it (`428 precondition-required`), sending nothing.
    Required(Required),
}

/// Why a write is refused with `428 precondition-required`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Required {
    /// It carries no precondition and fencegate knows no state of its key:
    /// the client reads the key once, or sends one.
    Unknown,
    /// fencegate knows the key's state but may not add a precondition (the
    /// request's signature covers the precondition headers): the client
    /// sends the one that names this state.
    Send(KeyState),
    /// A DELETE of a key last seen absent: S3 evaluates only `If-Match` on
    /// a DELETE, so nothing the storage evaluates names an absent key, and
    /// a late DELETE would remove what a later term wrote. There is nothing
    /// to delete; a client that believes otherwise reads the key again.
    DeleteOfAbsent,
    /// Its own precondition names no state the storage will compare.
    Unprotected(Unprotected),
    /// It changes what the key holds, but the storage evaluates no
    /// precondition on it ([`Operation::Unconditional`]).
    NotEvaluated,
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
    /// A `GET` or `HEAD` (`head`) of the key itself.
    Read { head: bool },
    /// A key write of `op`; `sent`: the state its added precondition named
    /// (`None`: it went with the client's own); `plain`: its answer shows
    /// the state it left ([`Classified::plain`]).
    Write {
        op: Operation,
        sent: Option<KeyState>,
        plain: bool,
    },
}

impl Exchange {
    /// Whether its answer can teach anything.
    pub fn teaches(&self) -> bool {
        self.kind != Kind::Nothing
    }

    /// Whether an answer of `status` to it teaches "absent" only with the
    /// error code the answer's body may carry ([`error_code`]): a 404 or
    /// 410 to a `GET` of the key, a 404 to its DELETE (a `HEAD`'s answer
    /// has no body).
    pub fn needs_code(&self, status: u16) -> bool {
        match &self.kind {
            Kind::Read { head } => !head && matches!(status, 404 | 410),
            Kind::Write {
                op: Operation::Delete,
                plain: true,
                ..
            } => status == 404,
            _ => false,
        }
    }
}

/// How the storage answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer<'a> {
    /// It answered `status`, with `etag`: its `ETag` header, if it sent
    /// exactly one; and `code`: the error code it gave (Azure's
    /// `x-ms-error-code` header, or the `<Code>` of an S3 error document),
    /// if any.
    Storage {
        status: u16,
        etag: Option<&'a [u8]>,
        code: Option<&'a [u8]>,
    },
    /// fencegate stopped waiting (a lost connection, a timeout): the write
    /// may or may not be applied, now or later.
    Unknown,
}

/// Whether a 404 or 410 with error code `code` says that the key itself is
/// absent: no code at all (a `HEAD`'s answer has no body; a plain store's
/// 404), S3's `NoSuchKey` or Azure's `BlobNotFound`. Any other code (S3's
/// `NoSuchVersion`, `NoSuchUpload`, `NoSuchBucket`; Azure's
/// `ContainerNotFound`) is about something else.
pub fn says_absent(code: Option<&[u8]>) -> bool {
    match code {
        None => true,
        Some(code) => code == b"NoSuchKey" || code == b"BlobNotFound",
    }
}

/// The error code an error document that begins with `body` names: the
/// text of its first `<Code>` element (S3 and Azure both), the rest of
/// `body` after `<Code>` if the element does not end within it, `None` if
/// it has no such element.
pub fn error_code(body: &[u8]) -> Option<&[u8]> {
    const OPEN: &[u8] = b"<Code>";
    const CLOSE: &[u8] = b"</Code>";
    let start = body.windows(OPEN.len()).position(|w| w == OPEN)? + OPEN.len();
    let rest = &body[start..];
    let end = rest
        .windows(CLOSE.len())
        .position(|w| w == CLOSE)
        .unwrap_or(rest.len());
    Some(rest[..end].trim_ascii())
}

/// The strong entity tag `value` names, if it is one: `"…"` with no `"`
/// inside (RFC 9110 §8.8.3). A weak one (`W/"…"`) names no state a write
/// can be conditioned on: `If-Match` compares strongly, so it never matches.
pub fn strong_tag(value: &[u8]) -> Option<&[u8]> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    let etagc = |b: &u8| *b == 0x21 || (0x23..=0x7e).contains(b) || *b >= 0x80;
    inner.iter().all(etagc).then_some(value)
}

/// Keys and their states in two generations: at most `generation` keys
/// in each; when the young one is full it becomes the old one, and the old
/// one is dropped.
#[derive(Debug)]
struct Generations {
    /// Keys seen or used since the last rotation.
    young: HashMap<Box<str>, KeyState>,
    /// Keys of the generation before; one used again moves to `young`.
    old: HashMap<Box<str>, KeyState>,
    generation: usize,
}

impl Generations {
    fn new(generation: usize) -> Self {
        Self {
            young: HashMap::new(),
            old: HashMap::new(),
            generation: generation.max(1),
        }
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    fn get(&self, key: &str) -> Option<&KeyState> {
        self.young.get(key).or_else(|| self.old.get(key))
    }

    fn contains(&self, key: &str) -> bool {
        self.young.contains_key(key) || self.old.contains_key(key)
    }

    /// The state of `key`, moved to the young generation if it was old.
    fn touch(&mut self, key: &str) -> Option<&KeyState> {
        if !self.young.contains_key(key) {
            let (key, state) = self.old.remove_entry(key)?;
            self.insert(key, state);
        }
        self.young.get(key)
    }

    /// Takes `key` out, with its allocation.
    fn take(&mut self, key: &str) -> Option<(Box<str>, KeyState)> {
        self.young
            .remove_entry(key)
            .or_else(|| self.old.remove_entry(key))
    }

    /// Remembers `state` for `key`; `owned`: the key's allocation, if the
    /// caller has one.
    fn set(&mut self, key: &str, owned: Option<Box<str>>, state: KeyState) {
        if let Some(known) = self.young.get_mut(key) {
            *known = state;
            return;
        }
        // A key of the old generation keeps its allocation.
        let key = match self.old.remove_entry(key) {
            Some((key, _)) => key,
            None => owned.unwrap_or_else(|| Box::from(key)),
        };
        self.insert(key, state);
    }

    fn remove(&mut self, key: &str) {
        self.young.remove(key);
        self.old.remove(key);
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

    fn clear(&mut self) {
        self.young = HashMap::new();
        self.old = HashMap::new();
    }
}

/// The newest state seen of each key, for at most `capacity` keys.
#[derive(Debug)]
pub struct KeyStates {
    /// Keys a write used (planned with, or learned from): half the
    /// capacity.
    written: Generations,
    /// Keys only read so far: the other half. A write that uses one moves
    /// it to `written`.
    read: Generations,
    /// Counts the terms of primacy this table served ([`Self::take_over`]):
    /// an answer to an exchange of an earlier one teaches nothing.
    epoch: u64,
}

impl KeyStates {
    /// A table of at most `capacity` keys (at least four).
    pub fn new(capacity: usize) -> Self {
        // Each half keeps two generations.
        let generation = (capacity / 4).max(1);
        Self {
            written: Generations::new(generation),
            read: Generations::new(generation),
            epoch: 0,
        }
    }

    fn exchange(&self, kind: Kind) -> Exchange {
        Exchange {
            kind,
            epoch: self.epoch,
        }
    }

    /// A request of `method` with `query` that reads a key on a route with
    /// preconditions (see [`reads_the_key`]).
    pub fn read(&self, method: &str, query: Option<&str>) -> Exchange {
        if reads_the_key(method, query) {
            self.exchange(Kind::Read {
                head: method == "HEAD",
            })
        } else {
            self.exchange(Kind::Nothing)
        }
    }

    /// How many keys it remembers.
    pub fn len(&self) -> usize {
        self.written.len() + self.read.len()
    }

    /// Whether it remembers no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it remembers.
    pub fn capacity(&self) -> usize {
        (self.written.generation + self.read.generation) * 2
    }

    /// The state remembered for `key`, without marking it used.
    pub fn known(&self, key: &str) -> Option<&KeyState> {
        self.written.get(key).or_else(|| self.read.get(key))
    }

    /// What to do with a write to `key` (`write`: its operation, and
    /// whether it is the plain write of the key); `own`: the preconditions
    /// it carries itself; `may_add`: a precondition may be added to it (not
    /// when its signature covers the precondition headers, as Azure's
    /// Shared Key does). With the exchange to learn its answer from.
    pub fn plan_write(
        &mut self,
        key: &str,
        write: Classified,
        own: &Own<'_>,
        may_add: bool,
    ) -> (Plan, Exchange) {
        let Classified { op, plain } = write;
        let nothing = |s: &Self| s.exchange(Kind::Nothing);
        let sent_with = |sent| Kind::Write { op, sent, plain };
        match op {
            Operation::Aside => return (Plan::AsSent, nothing(self)),
            Operation::Unconditional => {
                return (Plan::Required(Required::NotEvaluated), nothing(self))
            }
            _ => {}
        }
        if !own.is_none() {
            return match own.protects(op) {
                Ok(()) => (Plan::AsSent, self.exchange(sent_with(None))),
                Err(why) => (Plan::Required(Required::Unprotected(why)), nothing(self)),
            };
        }
        let known = self.used(key).cloned();
        if planted(Mutant::PreconditionDropped) && known.is_some() {
            return (Plan::AsSent, self.exchange(sent_with(known)));
        }
        let plan = match &known {
            None => return (Plan::Required(Required::Unknown), nothing(self)),
            Some(KeyState::Absent)
                if op.is_delete() && !planted(Mutant::DeleteOfAbsentConditioned) =>
            {
                return (Plan::Required(Required::DeleteOfAbsent), nothing(self));
            }
            Some(state) if !may_add => {
                return (Plan::Required(Required::Send(state.clone())), nothing(self));
            }
            Some(KeyState::Absent) => Plan::IfNoneMatchAny,
            Some(KeyState::Tagged(tag)) => Plan::IfMatch(tag.clone()),
        };
        (plan, self.exchange(sent_with(known)))
    }

    /// Learns what `answer` to `exchange` (an exchange about `key`) shows;
    /// nothing, if the exchange began in an earlier term of primacy.
    ///
    /// - A read answered 2xx or 304 shows the entity tag it carries (or, if
    ///   it carries no strong one, a state that cannot be named: the key is
    ///   forgotten); a 404 or 410 whose code [`says_absent`] shows the key
    ///   absent; anything else shows nothing.
    /// - A plain key write ([`Classified::plain`]) answered 2xx was
    ///   applied: a `DELETE` leaves the key absent, any other write leaves
    ///   it with the entity tag of the answer (none: forgotten). A plain
    ///   `DELETE` answered 404 with a code that [`says_absent`] found it
    ///   absent. Any other key write (a `DELETE` of a version, a write with
    ///   a parameter fencegate does not know) leaves a state its answer may
    ///   not show: the key is forgotten.
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
            (Kind::Nothing, _) | (Kind::Read { .. }, Answer::Unknown) => {}
            (Kind::Read { .. }, Answer::Storage { status, etag, code }) => match status {
                200..=299 | 304 => self.tagged(key, etag, false),
                404 | 410 if says_absent(code) => self.set(key, KeyState::Absent, false),
                _ => {}
            },
            (Kind::Write { op, sent, plain }, answer) => {
                let applied = match answer {
                    Answer::Storage { status, .. } => (200..=299).contains(&status),
                    Answer::Unknown => false,
                };
                let refused_taken_as_applied =
                    planted(Mutant::RefusedWriteTeaches) && answer != Answer::Unknown;
                let delete = *op == Operation::Delete;
                match answer {
                    _ if *op == Operation::DeleteVersion || !plain => self.forget(key),
                    Answer::Storage {
                        status: 404, code, ..
                    } if delete && says_absent(code) => {
                        self.set(key, KeyState::Absent, true);
                    }
                    _ if (applied || refused_taken_as_applied) && delete => {
                        self.set(key, KeyState::Absent, true)
                    }
                    Answer::Storage { etag, .. } if applied || refused_taken_as_applied => {
                        self.tagged(key, etag, true)
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
        self.written.clear();
        self.read.clear();
    }

    /// Forgets `key`.
    pub fn forget(&mut self, key: &str) {
        self.written.remove(key);
        self.read.remove(key);
    }

    /// Forgets `key` if its state is still `state`.
    fn forget_if(&mut self, key: &str, state: &KeyState) {
        if self.known(key) == Some(state) {
            self.forget(key);
        }
    }

    /// Remembers the state an `ETag` header shows, or forgets the key if it
    /// names none; `by_write`: learned from a write's answer.
    fn tagged(&mut self, key: &str, etag: Option<&[u8]>, by_write: bool) {
        match etag.and_then(strong_tag) {
            Some(tag) => {
                if let Some(KeyState::Tagged(known)) = self.known(key) {
                    if known.as_ref() == tag {
                        // Marked used where it is (or moved to the
                        // writers' half, for a write).
                        if by_write {
                            self.used(key);
                        } else if self.written.contains(key) {
                            self.written.touch(key);
                        } else {
                            self.read.touch(key);
                        }
                        return;
                    }
                }
                // An owned buffer behind a reference count: handing it to a
                // request (`Plan::IfMatch`) clones the count, copies nothing.
                let tag = Bytes::from_owner(Box::<[u8]>::from(tag));
                self.set(key, KeyState::Tagged(tag), by_write);
            }
            None => self.forget(key),
        }
    }

    /// The state of `key` for a write that uses it: in the writers' half
    /// from now on.
    fn used(&mut self, key: &str) -> Option<&KeyState> {
        if !self.written.contains(key) {
            let (owned, state) = self.read.take(key)?;
            self.written.set(key, Some(owned), state);
        }
        self.written.touch(key)
    }

    /// Remembers `state` for `key`: in the writers' half if it is there
    /// already or `by_write` (then it leaves the readers' half), else in
    /// the readers' half.
    fn set(&mut self, key: &str, state: KeyState, by_write: bool) {
        if by_write || self.written.contains(key) {
            let owned = self.read.take(key).map(|(k, _)| k);
            self.written.set(key, owned, state);
        } else {
            self.read.set(key, None, state);
        }
    }
}

#[cfg(test)]
mod tests;
