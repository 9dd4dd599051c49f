//! A lease's whole state as the etcd journal keeps it (the value of each
//! change, and of each snapshot entry), and how grants, renewals, releases
//! and forgetting change it. The member's journal
//! (`fencegate::cluster::journal`) serialises it; a takeover restores from
//! [`StoredLease::to_record`].

use std::collections::BTreeMap;

use crate::journal::record::{term_flags, wall_deadline, LeaseRecord, TermRecord};
use crate::mutant::{planted, Mutant};

/// One lease's whole state as the journal keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredLease {
    pub last_token: u64,
    pub transitions: u64,
    pub term: Option<StoredTerm>,
    /// The lease was forgotten (retention): a replay drops it, and every
    /// lease not in the log continues above `last_token`. A journal keeps
    /// that mark for all forgotten leases under the empty name
    /// ([`StoredLease::forgotten_mark`]), which snapshots write first.
    pub forgotten: bool,
}

/// A lease's latest term, with the SHA-256 digest of its lease id (never
/// the id itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTerm {
    pub token: u64,
    pub holder: String,
    pub ttl_ms: u64,
    pub lease_id_sha256: [u8; 32],
    pub released: bool,
    /// See [`TermRecord`]'s fields of the same names.
    pub granted_quiet: bool,
    pub released_quiet: bool,
    pub wall_deadline_ms: u64,
}

impl StoredTerm {
    /// The flags' bits in a record, as the file journal's.
    pub fn flags(&self) -> u8 {
        term_flags(self.granted_quiet, self.released_quiet)
    }
}

/// A grant as the journal records it.
#[derive(Clone, Copy, Debug)]
pub struct StoredGrant<'a> {
    pub token: u64,
    pub holder: &'a str,
    pub ttl_ms: u64,
    pub lease_id_sha256: [u8; 32],
    pub quiet: bool,
    /// The wall clock at the grant (Unix ms; 0: unknown).
    pub wall_ms: u64,
}

impl StoredLease {
    /// The mark of every lease forgotten so far: tokens up to `last_token`.
    pub fn forgotten_mark(last_token: u64) -> Self {
        Self {
            last_token,
            forgotten: true,
            ..Self::default()
        }
    }

    /// The record the lease store restores from (the term's id as its
    /// digest: see `RestartRule::hashed_ids`).
    pub fn to_record(&self, lease: String) -> LeaseRecord {
        LeaseRecord {
            lease,
            last_token: self.last_token,
            transitions: self.transitions,
            term: self.term.as_ref().map(|t| TermRecord {
                token: t.token,
                holder: t.holder.clone(),
                ttl_ms: t.ttl_ms,
                lease_id: t.lease_id_sha256,
                released: t.released,
                granted_quiet: t.granted_quiet,
                released_quiet: t.released_quiet,
                wall_deadline_ms: t.wall_deadline_ms,
            }),
        }
    }

    /// A new term: it replaces the current one (a lease's grants reach the
    /// journal in the order they were made, each after the term before
    /// had ended). It always changes the state (the `bool` of every
    /// change: whether the journal must write the lease's state).
    pub fn grant(&mut self, grant: StoredGrant<'_>) -> bool {
        self.last_token = self.last_token.max(grant.token);
        self.transitions += 1;
        self.term = Some(StoredTerm {
            token: grant.token,
            holder: grant.holder.to_owned(),
            ttl_ms: grant.ttl_ms,
            lease_id_sha256: grant.lease_id_sha256,
            released: false,
            granted_quiet: grant.quiet,
            released_quiet: false,
            wall_deadline_ms: wall_deadline(grant.wall_ms, grant.ttl_ms),
        });
        true
    }

    /// A renewal of term `token` at `wall_ms` (0: unknown) for `ttl_ms`;
    /// whether it changed anything (not for another or a released term).
    pub fn renew(&mut self, token: u64, ttl_ms: u64, wall_ms: u64) -> bool {
        match self.term.as_mut() {
            Some(t) if t.token == token && !t.released => {
                t.ttl_ms = ttl_ms;
                if wall_ms != 0 {
                    t.wall_deadline_ms = wall_deadline(wall_ms, ttl_ms);
                }
                true
            }
            _ => false,
        }
    }

    /// A release of term `token`; whether it changed anything (not for
    /// another or an already released term).
    pub fn release(&mut self, token: u64, quiet: bool) -> bool {
        if planted(Mutant::ReplayDropsReleases) {
            return false;
        }
        match self.term.as_mut() {
            Some(t) if t.token == token && !t.released => {
                t.released = true;
                t.released_quiet = quiet;
                true
            }
            _ => false,
        }
    }

    /// The lease is forgotten; its tokens continue above `last_token`.
    /// It always changes the state.
    pub fn forget(&mut self, last_token: u64) -> bool {
        self.last_token = self.last_token.max(last_token);
        self.forgotten = true;
        true
    }
}

/// The lease state a member loads from etcd: the snapshot's entries, then
/// the log's, folded in order with [`StoredState::apply`].
#[derive(Clone, Debug, Default)]
pub struct StoredState {
    leases: BTreeMap<String, StoredLease>,
    forgotten_above: u64,
}

impl StoredState {
    /// One lease's state as an entry holds it. A forgotten lease (or the
    /// mark of them all, under the empty name) leaves the state: every
    /// lease not in it continues above its tokens.
    pub fn apply(&mut self, lease: String, state: StoredLease) {
        if state.forgotten {
            self.leases.remove(&lease);
            if !planted(Mutant::ForgottenMarkDropped) {
                self.forgotten_above =
                    crate::journal::record::forgotten_above(self.forgotten_above, state.last_token);
            }
        } else {
            self.leases.insert(lease, state);
        }
    }

    /// Leases not in the state (forgotten, or never granted) continue
    /// above this.
    pub fn forgotten_above(&self) -> u64 {
        self.forgotten_above
    }

    /// `lease`'s state, which a change starts from (a forgotten lease starts
    /// afresh).
    pub fn lease(&self, lease: &str) -> StoredLease {
        self.leases.get(lease).cloned().unwrap_or_default()
    }

    /// Every lease, for the lease store to restore.
    pub fn records(&self) -> Vec<LeaseRecord> {
        self.leases
            .iter()
            .map(|(lease, stored)| stored.to_record(lease.clone()))
            .collect()
    }

    /// What a journal continues from: every lease, and the mark of the
    /// forgotten ones under the empty name (which snapshots write first).
    pub fn into_leases(self) -> BTreeMap<String, StoredLease> {
        let mut leases = self.leases;
        if self.forgotten_above > 0 {
            leases.insert(
                String::new(),
                StoredLease::forgotten_mark(self.forgotten_above),
            );
        }
        leases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(token: u64) -> StoredGrant<'static> {
        StoredGrant {
            token,
            holder: "a",
            ttl_ms: 1000,
            lease_id_sha256: [7; 32],
            quiet: true,
            wall_ms: 5_000,
        }
    }

    #[test]
    fn changes_follow_the_current_term() {
        let mut s = StoredLease::default();
        s.grant(grant(3));
        assert_eq!((s.last_token, s.transitions), (3, 1));
        assert!(s.renew(3, 2000, 6_000));
        assert_eq!(s.term.as_ref().unwrap().wall_deadline_ms, 8_000);
        assert!(!s.renew(2, 2000, 6_000), "another term");
        assert!(s.release(3, false));
        assert!(!s.release(3, false), "released already");
        assert!(!s.renew(3, 2000, 7_000), "a released term is not renewed");
        s.grant(grant(4));
        let r = s.to_record("l".into());
        assert_eq!((r.last_token, r.term.unwrap().token), (4, 4));
        s.forget(9);
        assert!(s.forgotten && s.last_token == 9);
    }

    #[test]
    fn a_forgotten_lease_leaves_the_loaded_state_and_raises_the_mark() {
        let mut state = StoredState::default();
        let mut a = state.lease("a");
        a.grant(grant(5));
        state.apply("a".into(), a);
        assert_eq!(state.records().len(), 1);
        let mut gone = state.lease("a");
        gone.forget(5);
        state.apply("a".into(), gone);
        assert!(state.records().is_empty());
        assert_eq!(state.forgotten_above(), 5);
        assert_eq!(
            state.lease("a"),
            StoredLease::default(),
            "a later change starts afresh"
        );
        // The mark of them all, under the empty name, counts the same.
        state.apply(String::new(), StoredLease::forgotten_mark(8));
        assert_eq!(state.forgotten_above(), 8);
        let leases = state.into_leases();
        assert_eq!(leases[""], StoredLease::forgotten_mark(8));
    }
}
