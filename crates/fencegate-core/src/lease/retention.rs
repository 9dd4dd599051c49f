//! When the lease store may forget a lease (`leases.retention_ms`, and
//! room made for a new name when the store is full): the rule the shell's
//! sweep runs under each lease's lock, and the simulator plays. What a
//! forgotten lease leaves behind is a mark its tokens continue above
//! ([`crate::lease::restart::RestartRule::forgotten_above`]).

use std::ops::DerefMut;

use crate::lease::inflight::Inflight;
use crate::lease::machine::LeaseState;
use crate::lease::restart::SETTLED;
use crate::mutant::{planted, Mutant};

/// How often the store's sweeper runs a pass.
pub const SWEEP_EVERY_MS: u64 = 100;

/// One pass of the sweep, at `now_ms` on the store's clock.
#[derive(Clone, Copy, Debug)]
pub struct Sweep {
    pub now_ms: u64,
    /// How long a lease must have been quiet (0: making room, where only
    /// the courtesy is cut short, never the safety).
    pub retention_ms: u64,
    /// The end of the store's restart (or takeover) window.
    pub unsettled_until_ms: u64,
    /// How many leases the pass forgets at most.
    pub most: usize,
}

/// A request naming a lease, for its last use ([`refreshes_last_use`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    Acquire,
    Renew,
    Release,
    /// `GET /_fence/leases/{name}`.
    Inspect,
    /// A write the fence admitted.
    AdmittedWrite,
    /// A write the fence refused.
    RefusedWrite,
}

/// Whether a request naming a lease counts as its use, which the
/// retention time runs from (`touched_ms` of [`Sweep::may_forget`]):
/// every one but an admitted write, whose live term keeps the lease anyway
/// (and which then touches no shared line). Only the courtesy rests on it:
/// a forgotten lease's tokens continue above its mark.
pub fn refreshes_last_use(by: Named) -> bool {
    !matches!(by, Named::AdmittedWrite)
}

impl Sweep {
    /// The sweep's pass: forgets every lease quiet for `retention_ms`.
    pub fn idle(now_ms: u64, retention_ms: u64, unsettled_until_ms: u64) -> Self {
        Self {
            now_ms,
            retention_ms,
            unsettled_until_ms,
            most: usize::MAX,
        }
    }

    /// The store is full and a new name asks in: forgets one lease with no
    /// live term and nothing waiting on or writing under it, however
    /// recently it was named.
    pub fn making_room(now_ms: u64, unsettled_until_ms: u64) -> Self {
        Self {
            now_ms,
            retention_ms: 0,
            unsettled_until_ms,
            most: 1,
        }
    }

    /// Whether a lease may be forgotten now: no live term; no request
    /// naming it (`touched_ms`) and no term ending for the retention time;
    /// no write of it from before the restart that may still be unfinished
    /// (`unsettled_from`, see [`crate::lease::restart::restart_holds_back`]);
    /// nobody holding it (`in_use`: a waiting acquire or write); and none of
    /// its writes (`writes`, if any was ever admitted; asked for last, as
    /// the shell locks them) in flight or of unknown outcome still
    /// settling: once forgotten, nothing would hold a newer term's writes
    /// back behind them.
    pub fn may_forget<W: DerefMut<Target = Inflight>>(
        &self,
        state: &LeaseState,
        touched_ms: u64,
        unsettled_from: u64,
        in_use: bool,
        writes: impl FnOnce() -> Option<W>,
    ) -> bool {
        let now_ms = self.now_ms;
        if in_use
            || state.is_held(now_ms)
            || (unsettled_from != SETTLED && now_ms < self.unsettled_until_ms)
        {
            return false;
        }
        let ended_ms = state.term().map_or(0, |t| t.deadline_ms);
        let quiet_since_ms = ended_ms.max(touched_ms);
        if now_ms < quiet_since_ms.saturating_add(self.retention_ms) {
            return false;
        }
        planted(Mutant::ForgottenWhileSettling) || writes().is_none_or(|mut w| w.is_settled(now_ms))
    }
}

/// A lease's last use after a request that counts as one
/// ([`refreshes_last_use`]) at `now_ms`: never earlier than it was (two
/// requests may be counted out of order).
pub fn last_use(touched_ms: u64, now_ms: u64) -> u64 {
    touched_ms.max(now_ms)
}

/// The mark a forgotten lease leaves: every lease not in the store
/// (this one now too) continues above it, so it is at least the lease's
/// last token; the journal's record of the forget carries it.
pub fn forgotten_mark(state: &LeaseState) -> u64 {
    let last_token = state.last_token();
    if planted(Mutant::ForgetMarkBelowLastToken) {
        return last_token.saturating_sub(1);
    }
    last_token
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::id::LeaseId;

    #[test]
    fn a_lease_is_forgotten_only_once_quiet_and_settled() {
        let mut state = LeaseState::default();
        let grant = state
            .acquire(0, "a", 100, LeaseId::from_bytes([1; 16]))
            .unwrap();
        let none = || None::<&mut Inflight>;
        let sweep = |now_ms, retention_ms| Sweep::idle(now_ms, retention_ms, 500);
        assert!(
            !sweep(50, 0).may_forget(&state, 0, SETTLED, false, none),
            "held"
        );
        assert!(
            !sweep(150, 100).may_forget(&state, 0, SETTLED, false, none),
            "quiet 50 ms"
        );
        assert!(
            !sweep(250, 100).may_forget(&state, 160, SETTLED, false, none),
            "named at 160"
        );
        assert!(sweep(250, 100).may_forget(&state, 0, SETTLED, false, none));
        assert!(
            !sweep(250, 100).may_forget(&state, 0, SETTLED, true, none),
            "in use"
        );
        assert!(
            !sweep(250, 100).may_forget(&state, 0, 1, false, none),
            "restart window"
        );
        assert!(
            sweep(600, 100).may_forget(&state, 0, 1, false, none),
            "window over"
        );
        let mut writes = Inflight::default();
        writes.add(grant.token);
        writes.remove(grant.token, false, 300);
        assert!(!sweep(250, 100).may_forget(&state, 0, SETTLED, false, || Some(&mut writes)));
        assert!(sweep(300, 100).may_forget(&state, 0, SETTLED, false, || Some(&mut writes)));
    }
}
