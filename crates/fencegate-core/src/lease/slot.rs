//! One lease as the lease store keeps it, and every procedure on it: a
//! grant, a renewal, a release, a write's admission and the sweep's
//! forgetting. Each takes the time and returns what is to be done (a
//! record for the journal, a decision, a mark), in the order the steps
//! must run; nothing here reads a clock, locks or waits.
//!
//! The lease store (`src/lease/store` in the `fencegate` package) calls
//! them under the lease's lock and carries out what they return, over its
//! journal and its waiters' wake-ups; the simulator (`fencegate-sim`) calls
//! the same with its own disk, network and clock. So a bug in the order of
//! the steps is one the simulator sees.
//!
//! What each keeps beside the slot is its own: the writes in flight
//! ([`Inflight`]) live in the store behind a lock of their own (finishing a
//! write touches only them), in the simulator beside the slot; both hand
//! them to the procedures that read them.

use std::ops::DerefMut;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::journal::record::{GrantRecord, Record};
use crate::journal::stored::{StoredGrant, StoredLease};
use crate::lease::admission::{self, Decision, TermChange, WriteCheck};
use crate::lease::id::text_digest;
use crate::lease::id::LeaseId;
use crate::lease::inflight::Inflight;
use crate::lease::machine::{AcquireRefused, Grant, LeaseState, Reject, Term};
use crate::lease::restart::{self, RestartRule, Restored};
use crate::lease::retention::{self, Named, Sweep};
use crate::mutant::{planted, Mutant};

/// One lease: its state, what a restart left unsettled, the journal's hint
/// of its term's end, and when a request last named it.
#[derive(Debug)]
pub struct Slot {
    state: LeaseState,
    /// Writes forwarded before the restart with this token or a later one
    /// may still be on their way to the storage ([`restart::SETTLED`]: none
    /// may): a write of a later term waits for the restart window.
    unsettled_from: u64,
    /// The current term's end on the wall clock as the journal last heard
    /// it (Unix ms; 0: unknown): see [`restart::wall_hint_due`].
    wall_deadline_ms: u64,
    /// When a request last named the lease ([`retention::refreshes_last_use`]),
    /// on the store's clock: retention counts from the later of this and
    /// the end of its last term. Atomic: a request that only reads the
    /// lease names it too.
    touched_ms: AtomicU64,
    /// A renewal's record was offered and not taken (a full queue): the
    /// next renewal offers one whether or not its hint is due, so a TTL
    /// the journal missed is recorded too.
    record_owed: bool,
}

/// An acquire, as [`Slot::grant`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct GrantAsk<'a> {
    pub lease: &'a str,
    pub holder: &'a str,
    pub ttl_ms: u64,
    /// The store's monotonic clock.
    pub now_ms: u64,
    /// The wall clock (Unix ms; 0: unknown), for the journal's hint.
    pub wall_ms: u64,
    /// The end of the store's restart (or takeover) window.
    pub unsettled_until_ms: u64,
}

/// A term granted under the lease's lock: its record to queue at once
/// (still under the lock, so the records of one lease keep their order),
/// and the term it replaced, put back ([`Slot::abandon`]) if the record
/// cannot be made durable.
#[derive(Debug)]
pub struct Granted {
    pub grant: Grant,
    pub previous: Option<Term>,
    pub record: GrantRecord,
}

/// What a renewal or a release presents: the term's token, its lease id
/// and (with authentication on) the caller.
#[derive(Clone, Copy, Debug)]
pub struct Presented<'a> {
    pub token: u64,
    pub lease_id: Option<&'a [u8]>,
    pub holder: Option<&'a str>,
}

/// A renewal's record of the term's end on the wall clock, when one is due
/// ([`restart::renewal_hint`]). The slot keeps the hint only once the
/// journal took the record ([`Slot::hint_taken`]): a dropped one is due
/// again at the next renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub token: u64,
    pub ttl_ms: u64,
    pub wall_ms: u64,
    /// The hint the record gives.
    wall_deadline_ms: u64,
}

/// A renewed term, and the record it asks for, if any.
#[derive(Debug)]
pub struct Renewed {
    pub grant: Grant,
    pub hint: Option<Hint>,
}

impl Slot {
    /// A lease the store does not hold yet (never granted, or forgotten):
    /// its tokens continue above the store's marks ([`restart::new_lease`]).
    pub fn new(rule: &RestartRule) -> Self {
        let (state, unsettled_from) = restart::new_lease(rule);
        Self {
            state,
            unsettled_from,
            wall_deadline_ms: 0,
            touched_ms: AtomicU64::new(0),
            record_owed: false,
        }
    }

    /// The lease's state.
    pub fn state(&self) -> &LeaseState {
        &self.state
    }

    /// The token from which writes sent before the restart may be
    /// unsettled ([`restart::SETTLED`]: none).
    pub fn unsettled_from(&self) -> u64 {
        self.unsettled_from
    }

    /// When a request last named the lease.
    pub fn touched_ms(&self) -> u64 {
        self.touched_ms.load(Ordering::Relaxed)
    }

    /// A request named the lease at `now_ms`: its last use, if the rule
    /// counts it as one.
    #[inline]
    pub fn named(&self, by: Named, now_ms: u64) {
        if retention::refreshes_last_use(by) {
            let _ = self
                .touched_ms
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                    Some(retention::last_use(t, now_ms))
                });
        }
    }

    /// A grant: the acquire, whether it is quiet (no write of an earlier
    /// term may be unfinished: `writes`, asked for only once the lease is
    /// granted, `None` if the lease never had a write), the term's end on
    /// the wall clock for the journal, and the record.
    pub fn grant<W: DerefMut<Target = Inflight>>(
        &mut self,
        ask: GrantAsk<'_>,
        lease_id: LeaseId,
        writes: impl FnOnce() -> Option<W>,
    ) -> Result<Granted, AcquireRefused> {
        self.named(Named::Acquire, ask.now_ms);
        let previous = self.state.term().cloned();
        let grant = self
            .state
            .acquire(ask.now_ms, ask.holder, ask.ttl_ms, lease_id.clone())?;
        let mut writes = writes().filter(|_| !planted(Mutant::GrantQuietOverOlderWrites));
        let quiet = self.quiet(
            TermChange::Granted(grant.token),
            writes.as_deref_mut(),
            ask.unsettled_until_ms,
            ask.now_ms,
        );
        drop(writes);
        self.wall_deadline_ms = restart::wall_deadline(ask.wall_ms, ask.ttl_ms);
        let record = GrantRecord {
            lease: ask.lease.to_owned(),
            token: grant.token,
            holder: ask.holder.to_owned(),
            ttl_ms: ask.ttl_ms,
            lease_id: lease_id.to_text(),
            quiet,
            wall_ms: ask.wall_ms,
        };
        Ok(Granted {
            grant,
            previous,
            record,
        })
    }

    /// Takes back grant `token`, whose record could not be made durable:
    /// `previous` is the lease's term again. Whether it was taken back
    /// (not if a later change came first).
    pub fn abandon(&mut self, token: u64, previous: Option<Term>) -> bool {
        self.state.abandon(token, previous)
    }

    /// A renewal of term `token` at `now_ms` (and `wall_ms` on the wall
    /// clock), for `ttl_ms` or the term's last TTL; with the hint the
    /// journal is to be given, if one is due.
    pub fn renew(
        &mut self,
        now_ms: u64,
        wall_ms: u64,
        presented: Presented<'_>,
        ttl_ms: Option<u64>,
    ) -> Result<Renewed, Reject> {
        self.named(Named::Renew, now_ms);
        let previous_ttl_ms = self.state.term().map_or(0, |t| t.ttl_ms);
        let grant = self.state.renew(
            now_ms,
            presented.token,
            presented.lease_id,
            presented.holder,
            ttl_ms,
        )?;
        let due = restart::renewal_hint(
            previous_ttl_ms,
            grant.ttl_ms,
            self.wall_deadline_ms,
            wall_ms,
        );
        let owed = self
            .record_owed
            .then(|| restart::wall_deadline(wall_ms, grant.ttl_ms));
        let hint = due.or(owed).map(|wall_deadline_ms| Hint {
            token: presented.token,
            ttl_ms: grant.ttl_ms,
            wall_ms,
            wall_deadline_ms,
        });
        // Owed until the journal takes it.
        self.record_owed = hint.is_some();
        if let Some(hint) = hint.filter(|_| planted(Mutant::HintKeptUntaken)) {
            self.hint_taken(&hint);
        }
        Ok(Renewed { grant, hint })
    }

    /// The journal took `hint`'s record: the slot keeps the hint, and owes
    /// no record.
    pub fn hint_taken(&mut self, hint: &Hint) {
        self.wall_deadline_ms = hint.wall_deadline_ms;
        self.record_owed = false;
    }

    /// A release of term `token` at `now_ms`: whether it is quiet (no
    /// write of it or of an earlier term may be unfinished: `writes`, asked
    /// for only once it is released), for its record.
    pub fn release<W: DerefMut<Target = Inflight>>(
        &mut self,
        now_ms: u64,
        presented: Presented<'_>,
        writes: impl FnOnce() -> Option<W>,
        unsettled_until_ms: u64,
    ) -> Result<bool, Reject> {
        self.named(Named::Release, now_ms);
        self.state.release(
            now_ms,
            presented.token,
            presented.lease_id,
            presented.holder,
        )?;
        let mut writes = writes();
        Ok(self.quiet(
            TermChange::Released(presented.token),
            writes.as_deref_mut(),
            unsettled_until_ms,
            now_ms,
        ))
    }

    fn quiet(
        &self,
        change: TermChange,
        inflight: Option<&mut Inflight>,
        unsettled_until_ms: u64,
        now_ms: u64,
    ) -> bool {
        admission::quiet(
            change,
            inflight,
            self.unsettled_from,
            unsettled_until_ms,
            now_ms,
        )
    }

    /// A write at `now_ms`: the lease's checks, then the handover barrier
    /// over its writes in flight (`inflight`, asked for only once the
    /// checks passed: a refused write costs no lock). An admitted write is
    /// counted in flight; a write told to wait is noted, so the writes
    /// that finish wake it.
    pub fn admit<W: DerefMut<Target = Inflight>>(
        &self,
        now_ms: u64,
        unsettled_until_ms: u64,
        write: &WriteCheck<'_>,
        inflight: impl FnOnce() -> W,
    ) -> Decision {
        let admit = match admission::check(&self.state, now_ms, write) {
            Ok(admit) => admit,
            Err(reject) => {
                self.named(Named::RefusedWrite, now_ms);
                return Decision::Refuse(reject);
            }
        };
        // Whether an admitted write counts as the lease's use is the rule's
        // (it does not: its live term keeps the lease).
        self.named(Named::AdmittedWrite, now_ms);
        let mut inflight = inflight();
        let decision = admission::barrier(
            &mut inflight,
            self.unsettled_from,
            unsettled_until_ms,
            now_ms,
            write,
            admit,
        );
        match decision {
            Decision::Admit(_) => inflight.add(write.token),
            Decision::Wait { .. } => inflight.note_waiter(),
            Decision::Refuse(_) => {}
        }
        decision
    }

    /// Whether the sweep may forget the lease now ([`Sweep::may_forget`];
    /// `in_use`: someone waits on it or writes under it), and if so the
    /// mark its tokens leave behind ([`retention::forgotten_mark`]): every
    /// lease the store no longer keeps continues above it. The caller
    /// raises its mark, records the forgetting and removes the slot, all
    /// before the lease's lock is let go.
    pub fn forget<W: DerefMut<Target = Inflight>>(
        &self,
        sweep: &Sweep,
        in_use: bool,
        writes: impl FnOnce() -> Option<W>,
    ) -> Option<u64> {
        let sweep = match planted(Mutant::SweepEndsTermEarly) {
            true => Sweep {
                now_ms: sweep.now_ms.saturating_add(retention::SWEEP_EVERY_MS),
                ..*sweep
            },
            false => *sweep,
        };
        sweep
            .may_forget(
                &self.state,
                self.touched_ms(),
                self.unsettled_from,
                in_use,
                writes,
            )
            .then(|| retention::forgotten_mark(&self.state))
    }
}

impl From<Restored> for Slot {
    /// A lease a start recovered ([`restart::restore`]).
    fn from(restored: Restored) -> Self {
        Self {
            state: restored.state,
            unsettled_from: restored.unsettled_from,
            wall_deadline_ms: restored.wall_deadline_ms,
            touched_ms: AtomicU64::new(0),
            record_owed: false,
        }
    }
}

/// A journal record of a lease, applied to the lease's state as the etcd
/// journal keeps it (a grant's lease id kept as its digest, never the id):
/// whether the state changed. The etcd journal and the simulator's etcd
/// both record through it.
pub fn record_into(stored: &mut StoredLease, record: &Record) -> bool {
    match record {
        Record::Grant {
            token,
            holder,
            ttl_ms,
            lease_id,
            quiet,
            wall_ms,
            ..
        } => stored.grant(StoredGrant {
            token: *token,
            holder,
            ttl_ms: *ttl_ms,
            lease_id_sha256: text_digest(lease_id),
            quiet: *quiet,
            wall_ms: *wall_ms,
        }),
        Record::Renew {
            token,
            ttl_ms,
            wall_ms,
            ..
        } => stored.renew(*token, *ttl_ms, *wall_ms),
        Record::Release { token, quiet, .. } => stored.release(*token, *quiet),
        Record::Forget { last_token, .. } => stored.forget(*last_token),
        Record::State(_) | Record::Noop | Record::Identity { .. } => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::restart::SETTLED;

    fn none() -> Option<&'static mut Inflight> {
        None
    }

    fn ask(now_ms: u64) -> GrantAsk<'static> {
        GrantAsk {
            lease: "orders",
            holder: "a",
            ttl_ms: 1000,
            now_ms,
            wall_ms: 1_000_000,
            unsettled_until_ms: 0,
        }
    }

    fn write(token: u64) -> WriteCheck<'static> {
        WriteCheck {
            token,
            lease_id: None,
            holder: None,
            margin_ms: 0,
            barrier: true,
        }
    }

    #[test]
    fn a_grant_over_an_older_terms_write_is_not_quiet_and_its_writes_wait() {
        let mut slot = Slot::new(&RestartRule::default());
        let mut writes = Inflight::default();
        let a = slot
            .grant(ask(0), LeaseId::from_bytes([1; 16]), none)
            .unwrap();
        assert!(a.record.quiet);
        assert_eq!(slot.unsettled_from(), SETTLED);
        let t1 = a.grant.token;
        assert!(matches!(
            slot.admit(10, 0, &write(t1), || &mut writes),
            Decision::Admit(_)
        ));
        // Term 1 ends with its write in flight; term 2's grant is not
        // quiet, and its write waits.
        let b = slot
            .grant(ask(1000), LeaseId::from_bytes([2; 16]), || {
                Some(&mut writes)
            })
            .unwrap();
        assert!(!b.record.quiet);
        assert!(matches!(
            slot.admit(1001, 0, &write(b.grant.token), || &mut writes),
            Decision::Wait { older_token, .. } if older_token == t1
        ));
        writes.remove(t1, false, 0);
        assert!(matches!(
            slot.admit(1002, 0, &write(b.grant.token), || &mut writes),
            Decision::Admit(_)
        ));
    }

    #[test]
    fn a_renewal_hint_is_kept_only_once_the_journal_took_it() {
        let mut slot = Slot::new(&RestartRule::default());
        let a = slot
            .grant(ask(0), LeaseId::from_bytes([1; 16]), none)
            .unwrap();
        let renew = |slot: &mut Slot, at: u64, ttl_ms: Option<u64>| {
            let presented = Presented {
                token: a.grant.token,
                lease_id: None,
                holder: None,
            };
            slot.renew(at, 1_000_000 + at, presented, ttl_ms)
                .unwrap()
                .hint
        };
        // Half a TTL on, the hint is due; dropped, it is due again.
        let hint = renew(&mut slot, 600, None).expect("due");
        assert_eq!(hint.wall_deadline_ms, 1_001_600);
        let hint = renew(&mut slot, 650, None).expect("due again: the first was not taken");
        slot.hint_taken(&hint);
        assert_eq!(renew(&mut slot, 700, None), None);
        // A new TTL is recorded; dropped, it is offered again though no
        // hint is due by the clock.
        let hint = renew(&mut slot, 710, Some(900)).expect("a new TTL");
        assert_eq!(hint.ttl_ms, 900);
        let hint = renew(&mut slot, 720, Some(900)).expect("owed: the first was not taken");
        slot.hint_taken(&hint);
        assert_eq!(renew(&mut slot, 730, Some(900)), None);
    }

    #[test]
    fn a_lease_is_forgotten_only_once_its_term_ended_and_leaves_its_mark() {
        let mut slot = Slot::new(&RestartRule::default());
        let a = slot
            .grant(ask(0), LeaseId::from_bytes([1; 16]), none)
            .unwrap();
        assert_eq!(slot.forget(&Sweep::making_room(999, 0), false, none), None);
        assert_eq!(
            slot.forget(&Sweep::making_room(1000, 0), false, none),
            Some(a.grant.token)
        );
        assert_eq!(slot.forget(&Sweep::making_room(1000, 0), true, none), None);
    }
}
