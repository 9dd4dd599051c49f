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
    pub precondition: Option<State>,
}

impl std::fmt::Display for StaleApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the storage applied a write of term {} to key {} after one of term {}, though its \
             precondition ({:?}) named no state the key held before that",
            self.token, self.key, self.later_token, self.precondition
        )
    }
}

/// A write as the storage applies it.
#[derive(Clone, Copy, Debug)]
pub struct KeyWrite {
    pub token: u64,
    /// `None`: a write that carries no precondition.
    pub precondition: Option<State>,
    pub delete: bool,
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

    /// Applies `write` to `name` at `now` if its precondition holds; checks
    /// the guarantee (see the module docs): `Err` is a violation.
    pub fn apply(
        &mut self,
        name: &str,
        now: u64,
        write: KeyWrite,
    ) -> Result<Outcome, StaleApplied> {
        let kind = self.kind;
        let current = self.state(name);
        // The first write of a later term the key took.
        let later = self.keys.get(name).and_then(|k| {
            k.applied
                .iter()
                .position(|a| a.token > write.token)
                .map(|i| (i, k.applied[i].token))
        });
        if write.precondition.is_some_and(|p| p != current) {
            if later.is_some() {
                self.refused_stale += 1;
            }
            return Ok(Outcome::Refused);
        }
        if let Some((i, later_token)) = later {
            let returned = write
                .precondition
                .is_some_and(|p| self.keys[name].held_before(p, i));
            if !returned {
                return Err(StaleApplied {
                    key: name.to_owned(),
                    token: write.token,
                    later_token,
                    precondition: write.precondition,
                });
            }
            self.returns += 1;
        }
        let next = if write.delete {
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

    fn put(token: u64, precondition: Option<State>, content: u64) -> KeyWrite {
        KeyWrite {
            token,
            precondition,
            delete: false,
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
