//! The admission decision for one write: the lease's checks ([`check`]),
//! then the handover barrier ([`barrier`]), which
//! [`crate::lease::slot::Slot::admit`] runs in that order under the
//! lease's lock with the store's `now_ms`, counting the write in flight
//! when it is admitted.

use crate::lease::inflight::Inflight;
use crate::lease::machine::{Admit, LeaseState, Reject};
use crate::lease::restart::restart_holds_back;
use crate::mutant::{planted, Mutant};

/// A write and how it is to be admitted.
#[derive(Clone, Copy, Debug)]
pub struct WriteCheck<'a> {
    pub token: u64,
    pub lease_id: Option<&'a [u8]>,
    /// The authenticated caller (with authentication on).
    pub holder: Option<&'a str>,
    /// A write needs more than this much of its term left.
    pub margin_ms: u64,
    /// Whether a newer term's writes wait for an older term's to finish
    /// (off only where tests show what the barrier prevents).
    pub barrier: bool,
}

/// Where a write stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It may reach the backend now.
    Admit(Admit),
    /// It must wait for older writes: those of `older_token` (or, after a
    /// restart, any before this term) may still reach the backend, until
    /// `until_ms` at the latest (`None`: until a write in flight is
    /// answered). It still has to be admitted before `deadline_ms`.
    Wait {
        older_token: u64,
        until_ms: Option<u64>,
        deadline_ms: u64,
    },
    /// It is refused.
    Refuse(Reject),
}

/// A write that waited at the barrier as long as it may: the older term's
/// writes were still unfinished (503).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitedTooLong {
    /// How long it waited.
    pub waited_ms: u64,
    /// When its wait would end by the clock alone, if only time holds it
    /// back and that is past the limit: refused at once, and told when to
    /// come back.
    pub retry_after_ms: Option<u64>,
}

/// Whether a write told to [`Decision::Wait`] at `now_ms` (until
/// `until_ms`), waiting since `started_ms`, may wait on: up to `max_wait_ms`
/// in all, and not at all when the wait is known to outlast that.
pub fn may_wait(
    started_ms: u64,
    now_ms: u64,
    max_wait_ms: u64,
    until_ms: Option<u64>,
) -> Result<(), WaitedTooLong> {
    let wait_until_ms = started_ms.saturating_add(max_wait_ms);
    let hopeless = until_ms.filter(|&until| until > wait_until_ms);
    if now_ms < wait_until_ms && hopeless.is_none() {
        return Ok(());
    }
    Err(WaitedTooLong {
        waited_ms: now_ms.saturating_sub(started_ms),
        retry_after_ms: hopeless.map(|until| until - now_ms),
    })
}

/// The lease's checks for a write at `now_ms`: token, lease id, holder,
/// the term's state and the admission margin. The shell runs them before it
/// touches the lease's writes in flight, so a refused write costs nothing.
pub fn check(state: &LeaseState, now_ms: u64, write: &WriteCheck<'_>) -> Result<Admit, Reject> {
    state.check_write(
        now_ms,
        write.margin_ms,
        write.token,
        write.lease_id,
        write.holder,
    )
}

/// The handover barrier for a write the lease's checks admitted: with the
/// barrier on, it waits while an older term's write may still be
/// unfinished: one in flight or settling (`inflight`), or one sent before
/// the restart (`unsettled_from` and `unsettled_until_ms`, see
/// [`crate::lease::restart`]).
pub fn barrier(
    inflight: &mut Inflight,
    unsettled_from: u64,
    unsettled_until_ms: u64,
    now_ms: u64,
    write: &WriteCheck<'_>,
    admit: Admit,
) -> Decision {
    if write.barrier && !planted(Mutant::BarrierOff) {
        if let Some(blocked) = inflight.older_than(write.token, now_ms) {
            return Decision::Wait {
                older_token: blocked.older_token,
                until_ms: blocked.until_ms,
                deadline_ms: admit.deadline_ms,
            };
        }
        // Writes of earlier terms sent before a restart may still be at the
        // backend: they left no trace but the time of the restart, and the
        // grant or release that said none could be.
        if restart_holds_back(unsettled_from, unsettled_until_ms, write.token, now_ms) {
            return Decision::Wait {
                older_token: write.token - 1,
                until_ms: Some(unsettled_until_ms),
                deadline_ms: admit.deadline_ms,
            };
        }
    }
    Decision::Admit(admit)
}

/// A change of term that the journal records with whether it is quiet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TermChange {
    /// Term `token` was granted: quiet if no write of an earlier term may
    /// be unfinished (then, after a restart, the term's own writes have
    /// nothing to wait for).
    Granted(u64),
    /// Term `token` was released: quiet if no write of it or of an earlier
    /// term may be unfinished (then, after a restart, the next term has
    /// nothing to wait for).
    Released(u64),
}

/// Whether `change` is quiet at `now_ms`: no write it covers may still be
/// unfinished at the storage, none sent before the restart (or its window
/// is over) and none in flight or settling now (`inflight`: `None` if the
/// lease never had a write). The journal records it, so the next start
/// need not hold the lease's later terms back.
pub fn quiet(
    change: TermChange,
    inflight: Option<&mut Inflight>,
    unsettled_from: u64,
    unsettled_until_ms: u64,
    now_ms: u64,
) -> bool {
    // Writes with a token below this one are covered.
    let below = match change {
        TermChange::Granted(token) => token,
        TermChange::Released(token) if planted(Mutant::ReleaseQuietOverOwnWrites) => token,
        TermChange::Released(token) => token.saturating_add(1),
    };
    !restart_holds_back(unsettled_from, unsettled_until_ms, below, now_ms)
        && inflight.is_none_or(|i| i.older_than(below, now_ms).is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_is_quiet_only_once_its_own_writes_are_done() {
        use crate::lease::restart::SETTLED;
        let mut writes = Inflight::default();
        writes.add(3);
        let quiet = |change, writes: &mut Inflight| quiet(change, Some(writes), SETTLED, 0, 10);
        // Term 3's own write does not keep its grant from being quiet...
        assert!(quiet(TermChange::Granted(3), &mut writes));
        // ...but keeps its release from it, and term 4's grant.
        assert!(!quiet(TermChange::Released(3), &mut writes));
        assert!(!quiet(TermChange::Granted(4), &mut writes));
        writes.remove(3, false, 0);
        assert!(quiet(TermChange::Released(3), &mut writes));
        // Before the restart window is over, any write from before it may
        // be unfinished.
        assert!(!super::quiet(TermChange::Granted(2), None, 1, 100, 10));
        assert!(super::quiet(TermChange::Granted(2), None, 1, 100, 100));
    }

    #[test]
    fn a_write_waits_at_the_barrier_up_to_the_limit_and_not_when_it_is_hopeless() {
        assert_eq!(may_wait(100, 100, 1000, None), Ok(()));
        assert_eq!(may_wait(100, 1099, 1000, Some(1100)), Ok(()));
        let late = may_wait(100, 1100, 1000, None).unwrap_err();
        assert_eq!((late.waited_ms, late.retry_after_ms), (1000, None));
        // Only time holds it back, and past the limit: refused at once, told
        // when to come back.
        let hopeless = may_wait(100, 150, 1000, Some(1500)).unwrap_err();
        assert_eq!(
            (hopeless.waited_ms, hopeless.retry_after_ms),
            (50, Some(1350))
        );
    }
}
