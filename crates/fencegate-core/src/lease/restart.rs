//! The restart rule: what a start (or a takeover, on another member's clock)
//! does with each lease its journal recovered, and how long writes of a
//! later term wait for writes that were sent before it.
//!
//! A process that stops leaves no trace of the writes it had forwarded but
//! the time of the start: for [`RestartRule::unsettled_ms`] after it (the
//! longest upstream deadline plus the settle time), such a write may still
//! reach the backend, so no write of a term that may follow one is admitted
//! until then. A recovered term that was not released is held for a full
//! TTL from the start (or less, if its wall-clock hint says it had less
//! left): no new holder starts until the old one could have finished.

pub use crate::journal::record::wall_deadline;
use crate::journal::record::LeaseRecord;
use crate::journal::recovery::Recovered;
use crate::lease::id::LeaseId;
use crate::lease::machine::{LeaseState, Term};
use crate::mutant::{planted, Mutant};
use crate::names::{InvalidName, LeaseName};

/// [`Restored::unsettled_from`] of a lease no write forwarded before the
/// restart can be unfinished for.
pub const SETTLED: u64 = u64::MAX;

/// What a restart must respect besides the recovered leases.
#[derive(Clone, Copy, Debug, Default)]
pub struct RestartRule {
    /// How long after the start a write forwarded before it may still reach
    /// the backend: the longest upstream deadline plus the settle time. Until
    /// then, no write of a term that may follow such a write is forwarded.
    pub unsettled_ms: u64,
    /// Every lease's tokens, recovered or new, continue above this.
    pub token_floor: u64,
    /// The journal may have lost records: every lease, recovered or not,
    /// may have had writes in flight, whatever the records kept say.
    pub lost_records: bool,
    /// The recovered terms carry the SHA-256 digest of each lease id, not
    /// its text (the lease state cluster members share in etcd).
    pub hashed_ids: bool,
    /// Leases not recovered (forgotten before the restart, or never
    /// granted) continue above this.
    pub forgotten_above: u64,
}

impl RestartRule {
    /// When the restart (or takeover) window of a start at `now_ms` ends:
    /// until then a write forwarded before the start may still reach the
    /// backend ([`restart_holds_back`]).
    pub fn window_until_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.unsettled_ms)
    }

    /// This rule for the leases a start `recovered` from its journal: above
    /// its floors, and with every lease unsettled if records were lost.
    pub fn recovered(self, recovered: &Recovered) -> Self {
        Self {
            token_floor: recovered.token_floor,
            lost_records: recovered.lost_records.is_some(),
            forgotten_above: recovered.forgotten_above,
            ..self
        }
    }
}

/// Whether a renewal is recorded in the journal: when it changes the term's
/// TTL (a start holds a recovered term for its recorded TTL), or when its
/// wall-clock hint is due ([`wall_hint_due`]). A term whose record the
/// journal dropped (a full queue) keeps its old hint, and is due again at
/// its next renewal.
pub fn renewal_recorded(previous_ttl_ms: u64, ttl_ms: u64, recorded_ms: u64, wall_ms: u64) -> bool {
    previous_ttl_ms != ttl_ms || wall_hint_due(recorded_ms, wall_ms, ttl_ms)
}

/// A renewal at `wall_ms` (the wall clock; 0: unknown) for `ttl_ms` of a
/// term whose TTL was `previous_ttl_ms` and whose end the journal last
/// heard as `hint_ms`: if it is to be recorded ([`renewal_recorded`]), the
/// hint the record gives (the term's end on the wall clock, as
/// [`wall_deadline`] makes it from a grant). The shell keeps it once the
/// journal took the record.
pub fn renewal_hint(previous_ttl_ms: u64, ttl_ms: u64, hint_ms: u64, wall_ms: u64) -> Option<u64> {
    renewal_recorded(previous_ttl_ms, ttl_ms, hint_ms, wall_ms)
        .then(|| wall_deadline(wall_ms, ttl_ms))
}

/// Whether a renewal at `wall_ms` (the wall clock) for `ttl_ms` must tell
/// the journal, whose last hint of the term's end was `recorded_ms`: once
/// the term's end would be more than half a TTL past it. So the true end
/// is never more than half a TTL past the hint (a lost lazy record aside),
/// at most two records a TTL for a term renewed however often.
pub fn wall_hint_due(recorded_ms: u64, wall_ms: u64, ttl_ms: u64) -> bool {
    wall_ms.saturating_add(ttl_ms) > recorded_ms.saturating_add(ttl_ms / 2)
        && !planted(Mutant::HintsNeverDue)
}

/// How long, at most, a recovered term whose journal hint of its end on
/// the wall clock is `wall_deadline_ms` can still have left at `wall_ms`,
/// allowing `tolerance_ms` of clock error (`u64::MAX`: no hint). See
/// [`wall_hint_due`] for the half TTL.
pub fn wall_hint_left_ms(
    wall_deadline_ms: u64,
    ttl_ms: u64,
    wall_ms: u64,
    tolerance_ms: u64,
) -> u64 {
    if wall_deadline_ms == 0 || wall_ms == 0 {
        return u64::MAX;
    }
    wall_deadline_ms
        .saturating_add(ttl_ms / 2)
        .saturating_add(tolerance_ms)
        .saturating_sub(wall_ms)
}

/// One lease as a start restores it.
#[derive(Debug)]
pub struct Restored {
    pub name: LeaseName,
    pub state: LeaseState,
    /// Writes forwarded before the restart with this token or a later one
    /// may still be on their way to the backend ([`SETTLED`]: none may).
    pub unsettled_from: u64,
    /// The current term's end on the wall clock as the journal last heard
    /// it (Unix ms; 0: unknown).
    pub wall_deadline_ms: u64,
    /// The recovered term had ended by its wall-clock hint: the shell
    /// records it as ended (not quiet), so a later start whose wall clock
    /// went back keeps it ended.
    pub ended_by_hint: bool,
}

/// [`RestartRule::unsettled_ms`]: how long after a start (or a takeover) a
/// write forwarded before it may still reach the backend: the longest
/// upstream deadline of any route, then the settle time.
pub fn unsettled_ms(longest_upstream_timeout_ms: u64, settle_ms: u64) -> u64 {
    longest_upstream_timeout_ms.saturating_add(settle_ms)
}

/// Why a recovered lease cannot be restored: the journal holds what no
/// grant wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Its name is not a lease name.
    InvalidName { lease: String, why: InvalidName },
    /// Its term's lease id is not one fencegate makes.
    MalformedLeaseId { lease: String },
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InvalidName { lease, why } => {
                write!(
                    f,
                    "the journal holds an invalid lease name {lease:?}: {why}"
                )
            }
            Self::MalformedLeaseId { lease } => {
                write!(f, "the journal holds a malformed lease id for {lease:?}")
            }
        }
    }
}

impl std::error::Error for RestoreError {}

/// What a start at `now_ms` (the proxy's clock) and `wall_ms` (the wall
/// clock) makes of one recovered lease: tokens continue above the floor,
/// an unreleased term is held for a full TTL or what its hint allows, and
/// the lease's later terms wait for the restart window unless the journal
/// says no write can be unfinished (a quiet grant or release).
pub fn restore(
    lease: LeaseRecord,
    rule: &RestartRule,
    now_ms: u64,
    wall_ms: u64,
    tolerance_ms: u64,
) -> Result<Restored, RestoreError> {
    let name = LeaseName::new(lease.lease.as_str()).map_err(|why| RestoreError::InvalidName {
        lease: lease.lease.clone(),
        why,
    })?;
    // Which writes forwarded before the restart may be unfinished: none
    // after a quiet release, only the term's own after a quiet grant, else
    // any (every lease's, if records may be lost).
    let unsettled_from = match &lease.term {
        _ if rule.lost_records => 1,
        Some(t) if t.released && t.released_quiet => SETTLED,
        Some(t) if t.granted_quiet => t.token,
        _ => 1,
    };
    let (held_ms, wall_deadline_ms) = match &lease.term {
        Some(t) if !t.released && planted(Mutant::RestartRuleOff) => (0, t.wall_deadline_ms),
        Some(t) if !t.released => (
            wall_hint_left_ms(t.wall_deadline_ms, t.ttl_ms, wall_ms, tolerance_ms),
            t.wall_deadline_ms,
        ),
        _ => (u64::MAX, 0),
    };
    let term = match lease.term {
        None => None,
        Some(t) => Some(Term {
            token: t.token,
            holder: t.holder.into(),
            lease_id: if rule.hashed_ids {
                LeaseId::from_sha256(t.lease_id)
            } else {
                LeaseId::from_text(t.lease_id).ok_or_else(|| RestoreError::MalformedLeaseId {
                    lease: lease.lease.clone(),
                })?
            },
            ttl_ms: t.ttl_ms,
            deadline_ms: 0,
            released: t.released,
        }),
    };
    let last_token = if planted(Mutant::TokenFloorIgnored) {
        lease.last_token
    } else {
        lease.last_token.max(rule.token_floor)
    };
    let state = LeaseState::restored(now_ms, last_token, lease.transitions, term, held_ms);
    let ended_by_hint = held_ms == 0 && state.term().is_some();
    Ok(Restored {
        name,
        state,
        unsettled_from,
        wall_deadline_ms,
        ended_by_hint,
    })
}

/// A release a start records for a recovered term its wall-clock hint
/// ended: not quiet (its writes may be unfinished), so a later start whose
/// wall clock went back keeps it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    pub lease: LeaseName,
    pub token: u64,
}

impl Ending {
    /// Whether the release is recorded as quiet: never, since the term's
    /// writes may still be unfinished.
    pub const fn quiet(&self) -> bool {
        false
    }
}

/// Every lease a start recovered, restored ([`restore`]), and the releases
/// it must record.
#[derive(Debug, Default)]
pub struct Restoration {
    pub leases: Vec<Restored>,
    pub endings: Vec<Ending>,
}

/// [`restore`] for each of `leases`; the terms their hints ended become
/// [`Ending`]s.
pub fn restore_all(
    leases: Vec<LeaseRecord>,
    rule: &RestartRule,
    now_ms: u64,
    wall_ms: u64,
    tolerance_ms: u64,
) -> Result<Restoration, RestoreError> {
    let mut all = Restoration::default();
    for lease in leases {
        let restored = restore(lease, rule, now_ms, wall_ms, tolerance_ms)?;
        if let Some(t) = restored.state.term().filter(|_| restored.ended_by_hint) {
            all.endings.push(Ending {
                lease: restored.name.clone(),
                token: t.token,
            });
        }
        all.leases.push(restored);
    }
    Ok(all)
}

/// Whether the restart window still holds back a write of `token` at
/// `now_ms`: writes sent before the restart with a token of
/// `unsettled_from` or later may be unfinished until `unsettled_until_ms`.
pub fn restart_holds_back(
    unsettled_from: u64,
    unsettled_until_ms: u64,
    token: u64,
    now_ms: u64,
) -> bool {
    unsettled_from < token && now_ms < unsettled_until_ms && !planted(Mutant::RestartWindowSkipped)
}

/// A lease a start did not recover (never granted, forgotten, or lost
/// with the records): its tokens continue above the floors, and if records
/// may have been lost, its later terms wait for the restart window too
/// (writes of a term the journal lost may still be at the backend).
pub fn new_lease(rule: &RestartRule) -> (LeaseState, u64) {
    let floor = if planted(Mutant::TokenFloorIgnored) {
        0
    } else {
        rule.token_floor.max(rule.forgotten_above)
    };
    let unsettled_from = if rule.lost_records { 1 } else { SETTLED };
    (LeaseState::above(floor), unsettled_from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::record::TermRecord;

    #[test]
    fn a_renewal_is_recorded_when_its_ttl_changes_or_its_hint_is_due() {
        // Same TTL, hint recorded a moment ago: nothing to tell.
        assert!(!renewal_recorded(1000, 1000, 10_000 + 1000, 10_000));
        // A new TTL always is, however fresh the hint.
        assert!(renewal_recorded(1000, 2000, 10_000 + 1000, 10_000));
        // Half a TTL later the hint is due.
        assert!(renewal_recorded(1000, 1000, 10_000 + 1000, 10_501));
    }

    fn record(term: TermRecord) -> LeaseRecord {
        LeaseRecord {
            lease: "orders".into(),
            last_token: term.token,
            transitions: 1,
            term: Some(term),
        }
    }

    fn term(token: u64) -> TermRecord {
        TermRecord {
            token,
            holder: "a".into(),
            lease_id: [b'a'; 32],
            ttl_ms: 1000,
            released: false,
            granted_quiet: false,
            released_quiet: false,
            wall_deadline_ms: 0,
        }
    }

    #[test]
    fn an_unreleased_term_is_held_a_full_ttl_from_the_start() {
        let r = restore(record(term(3)), &RestartRule::default(), 500, 0, 0).unwrap();
        assert!(r.state.is_held(1499));
        assert!(!r.state.is_held(1500));
        assert_eq!(r.unsettled_from, 1);
        assert!(!r.ended_by_hint);
    }

    #[test]
    fn quiet_records_narrow_what_may_be_unfinished() {
        let quiet_grant = TermRecord {
            granted_quiet: true,
            ..term(3)
        };
        let r = restore(record(quiet_grant), &RestartRule::default(), 0, 0, 0).unwrap();
        assert_eq!(r.unsettled_from, 3);
        assert!(!restart_holds_back(r.unsettled_from, 100, 3, 0));
        assert!(restart_holds_back(r.unsettled_from, 100, 4, 99));
        assert!(!restart_holds_back(r.unsettled_from, 100, 4, 100));
        let quiet_release = TermRecord {
            released: true,
            released_quiet: true,
            ..term(3)
        };
        let r = restore(record(quiet_release), &RestartRule::default(), 0, 0, 0).unwrap();
        assert_eq!(r.unsettled_from, SETTLED);
        let lost = RestartRule {
            lost_records: true,
            ..RestartRule::default()
        };
        let r = restore(record(quiet_release_again()), &lost, 0, 0, 0).unwrap();
        assert_eq!(r.unsettled_from, 1, "records may be lost: anything may be");
    }

    fn quiet_release_again() -> TermRecord {
        TermRecord {
            released: true,
            released_quiet: true,
            ..term(3)
        }
    }

    #[test]
    fn a_wall_clock_hint_shortens_or_ends_the_recovered_term() {
        let hinted = TermRecord {
            wall_deadline_ms: 10_000,
            ..term(3)
        };
        // 200 ms left by the hint, plus half a TTL of slack: 700 ms.
        let r = restore(record(hinted.clone()), &RestartRule::default(), 0, 9_800, 0).unwrap();
        assert!(r.state.is_held(699) && !r.state.is_held(700));
        let r = restore(
            record(hinted.clone()),
            &RestartRule::default(),
            0,
            20_000,
            0,
        )
        .unwrap();
        assert!(r.ended_by_hint && !r.state.is_held(0));
        // A start records each term its hint ended as a release that is not
        // quiet: its writes may still be unfinished.
        let leases = vec![
            record(hinted),
            LeaseRecord {
                lease: "idle".into(),
                ..record(term(1))
            },
        ];
        let all = restore_all(leases, &RestartRule::default(), 0, 20_000, 0).unwrap();
        assert_eq!(all.leases.len(), 2);
        assert_eq!(
            all.endings,
            [Ending {
                lease: LeaseName::new("orders").unwrap(),
                token: 3,
            }]
        );
        assert!(!all.endings[0].quiet());
    }

    #[test]
    fn tokens_continue_above_the_floor() {
        let rule = RestartRule {
            token_floor: 100,
            ..RestartRule::default()
        };
        let r = restore(record(term(3)), &rule, 0, 0, 0).unwrap();
        assert_eq!(r.state.last_token(), 100);
    }
}
