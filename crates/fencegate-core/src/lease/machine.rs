//! The pure lease state machine: integer milliseconds in, outcomes out.
//!
//! No clock reads, no I/O, no locks, no async. The caller passes `now_ms` from
//! the proxy's monotonic clock and gets back an outcome; the shell in
//! [`super::store`] owns the concurrency and the persistence.
//!
//! The rules, exactly as the contract states them:
//! - a term is live while `now_ms < deadline_ms`; at `now_ms == deadline_ms` it
//!   has expired, and an expired term is never revived;
//! - acquire succeeds only when there is no live term, and issues a token
//!   strictly greater than every token issued for this lease before;
//! - writes, renewals and releases are checked in one order: the token against
//!   the current token (unknown, stale), then the lease id, then (with
//!   authentication on) the caller against the term's holder, then the term's
//!   state (released, expired). All in one call, so nothing can change
//!   between the checks.

use compact_str::CompactString;

use super::id::LeaseId;
use crate::mutant::{planted, Mutant};

/// One grant of a lease.
#[derive(Clone, Debug)]
pub struct Term {
    /// The fencing token that orders this term among the lease's terms.
    pub token: u64,
    /// Who asked for it (free text chosen by the client). Kept inline when
    /// short (24 bytes or less), as most holder names are.
    pub holder: CompactString,
    /// The credential handed to the acquirer.
    pub lease_id: LeaseId,
    /// The TTL of the last acquire or renew, used by renewals without a TTL.
    pub ttl_ms: u64,
    /// The term is live while `now_ms < deadline_ms`.
    pub deadline_ms: u64,
    /// Set once by a successful release; a released term stays released.
    pub released: bool,
}

impl Term {
    /// Whether the term can still be written under at `now_ms`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        !self.released && now_ms < self.deadline_ms
    }

    /// Milliseconds until the deadline, 0 once expired or released.
    pub fn expires_in_ms(&self, now_ms: u64) -> u64 {
        if self.released {
            0
        } else {
            self.deadline_ms.saturating_sub(now_ms)
        }
    }
}

/// The state of one named lease.
#[derive(Clone, Debug, Default)]
pub struct LeaseState {
    term: Option<Term>,
    /// The highest token ever issued for this lease. Never decreases, even if a
    /// grant is abandoned, so a token is never handed out twice.
    last_token: u64,
    /// How many terms have been granted.
    transitions: u64,
}

/// Why a write, renew or release was refused. Ordered as the checks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// The token was never issued for this lease: no term yet, token 0, or a
    /// token above the current one.
    UnknownToken { current: u64 },
    /// The token belongs to an earlier term.
    StaleToken { current: u64 },
    /// Current token, but the lease id is not that term's.
    LeaseIdMismatch { current: u64 },
    /// Current token, but the authenticated caller is not the term's holder
    /// (checked only when authentication is on).
    NotHolder { current: u64 },
    /// Current token, but the term was released.
    Released { current: u64 },
    /// Current token, but `now_ms >= deadline_ms`.
    Expired { current: u64 },
}

impl Reject {
    /// The lease's current token when the check ran (0 if none was issued).
    pub fn current_token(&self) -> u64 {
        match *self {
            Reject::UnknownToken { current }
            | Reject::StaleToken { current }
            | Reject::LeaseIdMismatch { current }
            | Reject::NotHolder { current }
            | Reject::Released { current }
            | Reject::Expired { current } => current,
        }
    }
}

/// Acquire was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireRefused {
    /// Another term is live.
    Held(Held),
    /// Every u64 token has been issued; the lease can never be granted again.
    TokensExhausted,
}

/// The live term that blocks an acquire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub holder: String,
    pub token: u64,
    pub expires_in_ms: u64,
}

/// A successful acquire or renew.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub token: u64,
    pub ttl_ms: u64,
    pub deadline_ms: u64,
}

impl Grant {
    /// What the holder is told at `now_ms` of the time its term has left:
    /// the time since the grant or renewal (persisting it, for a grant)
    /// counts against the term.
    pub fn expires_in_ms(&self, now_ms: u64) -> u64 {
        if planted(Mutant::PersistTimePromised) {
            return self.ttl_ms;
        }
        self.deadline_ms.saturating_sub(now_ms)
    }
}

/// A write that passed every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admit {
    pub token: u64,
    pub deadline_ms: u64,
}

/// What inspection shows of a lease. Never the lease id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub state: TermState,
    pub holder: String,
    pub token: u64,
    pub expires_in_ms: u64,
    pub ttl_ms: u64,
    pub transitions: u64,
}

/// The state of a lease's current term as inspection reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TermState {
    Held,
    Expired,
    Released,
}

impl TermState {
    pub fn as_str(&self) -> &'static str {
        match self {
            TermState::Held => "held",
            TermState::Expired => "expired",
            TermState::Released => "released",
        }
    }
}

impl LeaseState {
    /// The state of a lease after a restart. A term that was not released is
    /// held for a full TTL from `now_ms`, or for `held_ms` if that is less:
    /// it may have been live when the process stopped, and only a hint
    /// (`held_ms`: how long it can at most have had left) tells for how
    /// much longer, so no new holder may start until the old one could
    /// have finished. With `held_ms` 0 the term has ended.
    pub fn restored(
        now_ms: u64,
        last_token: u64,
        transitions: u64,
        term: Option<Term>,
        held_ms: u64,
    ) -> Self {
        let term = term.map(|mut t| {
            if !t.released {
                t.deadline_ms = now_ms.saturating_add(t.ttl_ms.min(held_ms));
            }
            t
        });
        Self {
            last_token: last_token.max(term.as_ref().map_or(0, |t| t.token)),
            transitions,
            term,
        }
    }

    /// A lease never granted whose tokens must continue above `floor` (a
    /// store that may have lost records of it).
    pub fn above(floor: u64) -> Self {
        Self {
            last_token: floor,
            ..Self::default()
        }
    }

    /// The current (latest) term, live or not.
    pub fn term(&self) -> Option<&Term> {
        self.term.as_ref()
    }

    /// The highest token issued for this lease (0 if none).
    pub fn last_token(&self) -> u64 {
        self.last_token
    }

    /// Whether a term is live at `now_ms`.
    pub fn is_held(&self, now_ms: u64) -> bool {
        self.term.as_ref().is_some_and(|t| t.is_live(now_ms))
    }

    /// Grants a new term to `holder` if no term is live at `now_ms`.
    ///
    /// The TTL is expected to be validated by the caller; the deadline saturates
    /// rather than overflows.
    pub fn acquire(
        &mut self,
        now_ms: u64,
        holder: &str,
        ttl_ms: u64,
        lease_id: LeaseId,
    ) -> Result<Grant, AcquireRefused> {
        if let Some(term) = self.term.as_ref().filter(|t| t.is_live(now_ms)) {
            return Err(AcquireRefused::Held(Held {
                holder: term.holder.to_string(),
                token: term.token,
                expires_in_ms: term.expires_in_ms(now_ms),
            }));
        }
        let token = self
            .last_token
            .checked_add(1)
            .ok_or(AcquireRefused::TokensExhausted)?;
        let deadline_ms = now_ms.saturating_add(ttl_ms);
        self.last_token = token;
        self.transitions += 1;
        self.term = Some(Term {
            token,
            holder: holder.into(),
            lease_id,
            ttl_ms,
            deadline_ms,
            released: false,
        });
        Ok(Grant {
            token,
            ttl_ms,
            deadline_ms,
        })
    }

    /// Undoes a grant whose record could not be persisted, so the term never
    /// existed for anyone. The token stays consumed. Returns whether the grant
    /// was still the current term.
    pub fn abandon(&mut self, token: u64, previous: Option<Term>) -> bool {
        if self.term.as_ref().is_some_and(|t| t.token == token) {
            self.term = previous;
            self.transitions -= 1;
            true
        } else {
            false
        }
    }

    /// Runs the contract's checks, in order, for a write, renew or release.
    ///
    /// `lease_id` is `None` when the caller does not require one (the config
    /// switch); a presented id is always checked. `holder` is the
    /// authenticated caller when authentication is on (`None` otherwise): it
    /// must be the term's holder.
    pub fn check(
        &self,
        now_ms: u64,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
    ) -> Result<Admit, Reject> {
        let current = self.term.as_ref().map_or(0, |t| t.token);
        let Some(term) = self.term.as_ref() else {
            return Err(Reject::UnknownToken { current });
        };
        if token == 0 || token > current {
            return Err(Reject::UnknownToken { current });
        }
        if token < current {
            return Err(Reject::StaleToken { current });
        }
        if let Some(presented) = lease_id {
            if !term.lease_id.matches(presented) {
                return Err(Reject::LeaseIdMismatch { current });
            }
        }
        if holder.is_some_and(|h| h != term.holder) {
            return Err(Reject::NotHolder { current });
        }
        if term.released {
            return Err(Reject::Released { current });
        }
        if now_ms >= term.deadline_ms
            && !(planted(Mutant::ExpiryInclusive) && now_ms == term.deadline_ms)
        {
            return Err(Reject::Expired { current });
        }
        Ok(Admit {
            token,
            deadline_ms: term.deadline_ms,
        })
    }

    /// [`LeaseState::check`] for a write, which must also have more than
    /// `margin_ms` of its term left (the admission margin; 0 admits a write
    /// until the deadline). A write inside the margin is refused as expired.
    pub fn check_write(
        &self,
        now_ms: u64,
        margin_ms: u64,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
    ) -> Result<Admit, Reject> {
        let admit = self.check(now_ms, token, lease_id, holder)?;
        if now_ms.saturating_add(margin_ms) >= admit.deadline_ms {
            return Err(Reject::Expired { current: token });
        }
        Ok(admit)
    }

    /// Extends the live term to `now_ms + ttl_ms` (the term's TTL if `None`).
    pub fn renew(
        &mut self,
        now_ms: u64,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
        ttl_ms: Option<u64>,
    ) -> Result<Grant, Reject> {
        self.check(now_ms, token, lease_id, holder)?;
        let term = self
            .term
            .as_mut()
            .expect("check succeeds only with a current term");
        let ttl_ms = ttl_ms.unwrap_or(term.ttl_ms);
        term.ttl_ms = ttl_ms;
        term.deadline_ms = now_ms.saturating_add(ttl_ms);
        Ok(Grant {
            token,
            ttl_ms,
            deadline_ms: term.deadline_ms,
        })
    }

    /// Ends the live term now, so another holder may acquire at once.
    pub fn release(
        &mut self,
        now_ms: u64,
        token: u64,
        lease_id: Option<&[u8]>,
        holder: Option<&str>,
    ) -> Result<(), Reject> {
        self.check(now_ms, token, lease_id, holder)?;
        if let Some(term) = self.term.as_mut() {
            term.released = true;
        }
        Ok(())
    }

    /// What inspection shows at `now_ms`; `None` if the lease was never granted.
    pub fn view(&self, now_ms: u64) -> Option<View> {
        let term = self.term.as_ref()?;
        let state = if term.released {
            TermState::Released
        } else if now_ms < term.deadline_ms {
            TermState::Held
        } else {
            TermState::Expired
        };
        Some(View {
            state,
            holder: term.holder.to_string(),
            token: term.token,
            expires_in_ms: if state == TermState::Held {
                term.expires_in_ms(now_ms)
            } else {
                0
            },
            ttl_ms: term.ttl_ms,
            transitions: self.transitions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_told_what_its_term_has_left_when_answered() {
        let grant = Grant {
            token: 1,
            ttl_ms: 1000,
            deadline_ms: 1500,
        };
        // Persisted from 500 to 530: 30 ms of the term are gone.
        assert_eq!(grant.expires_in_ms(530), 970);
        assert_eq!(grant.expires_in_ms(2000), 0, "ended while persisted");
    }

    const S: u64 = 1000;

    fn id(n: u8) -> LeaseId {
        LeaseId::from_bytes([n; 16])
    }

    fn key(n: u8) -> Vec<u8> {
        id(n).expose().as_bytes().to_vec()
    }

    /// The seed scenario: TTL 5 s, one lease `orders`, holders A, B, C.
    #[test]
    fn seed_scenario() {
        let mut orders = LeaseState::default();
        let (a, b, c) = (key(0xa), key(0xb), key(0xc));

        // t=0 A acquires: token 1.
        let g = orders.acquire(0, "A", 5 * S, id(0xa)).unwrap();
        assert_eq!(g.token, 1);
        // t=2 A writes: accepted.
        assert!(orders.check(2 * S, 1, Some(&a), None).is_ok());
        // t=4 A renews: deadline 9.
        let g = orders.renew(4 * S, 1, Some(&a), None, None).unwrap();
        assert_eq!(g.deadline_ms, 9 * S);
        // t=8 A writes: accepted.
        assert!(orders.check(8 * S, 1, Some(&a), None).is_ok());
        // t=10 A writes: lease-expired; A renews: lease-expired.
        assert_eq!(
            orders.check(10 * S, 1, Some(&a), None),
            Err(Reject::Expired { current: 1 })
        );
        assert_eq!(
            orders.renew(10 * S, 1, Some(&a), None, None),
            Err(Reject::Expired { current: 1 })
        );
        // t=10 B acquires: token 2.
        assert_eq!(
            orders.acquire(10 * S, "B", 5 * S, id(0xb)).unwrap().token,
            2
        );
        // t=11 B writes: accepted.
        assert!(orders.check(11 * S, 2, Some(&b), None).is_ok());
        // t=12 token 1 with B's lease id: stale; A with its own id: stale.
        assert_eq!(
            orders.check(12 * S, 1, Some(&b), None),
            Err(Reject::StaleToken { current: 2 })
        );
        assert_eq!(
            orders.check(12 * S, 1, Some(&a), None),
            Err(Reject::StaleToken { current: 2 })
        );
        // C acquires: held by B.
        assert_eq!(
            orders.acquire(12 * S, "C", 5 * S, id(0xc)),
            Err(AcquireRefused::Held(Held {
                holder: "B".into(),
                token: 2,
                expires_in_ms: 3 * S
            }))
        );
        // A releases with token 1: stale. B releases: done.
        assert_eq!(
            orders.release(12 * S, 1, Some(&a), None),
            Err(Reject::StaleToken { current: 2 })
        );
        orders.release(12 * S, 2, Some(&b), None).unwrap();
        // t=13 C acquires: token 3. t=14 C writes: accepted.
        assert_eq!(
            orders.acquire(13 * S, "C", 5 * S, id(0xc)).unwrap().token,
            3
        );
        assert!(orders.check(14 * S, 3, Some(&c), None).is_ok());
        assert_eq!(orders.view(14 * S).unwrap().transitions, 3);
    }

    #[test]
    fn restored_terms_are_held_a_full_ttl_from_the_restart() {
        let term = Term {
            token: 4,
            holder: "A".into(),
            lease_id: id(1),
            ttl_ms: 500,
            deadline_ms: 0,
            released: false,
        };
        let mut l = LeaseState::restored(10, 4, 4, Some(term.clone()), u64::MAX);
        assert!(l.check(509, 4, Some(&key(1)), None).is_ok());
        assert!(l.acquire(509, "B", 100, id(2)).is_err());
        assert_eq!(l.acquire(510, "B", 100, id(2)).unwrap().token, 5);

        let released = Term {
            released: true,
            ..term.clone()
        };
        let mut l = LeaseState::restored(10, 9, 4, Some(released), u64::MAX);
        assert_eq!(
            l.check(10, 4, Some(&key(1)), None),
            Err(Reject::Released { current: 4 })
        );
        assert_eq!(l.acquire(10, "B", 100, id(2)).unwrap().token, 10);

        // A hint shortens the hold, never lengthens it; 0 ends the term.
        let mut l = LeaseState::restored(10, 4, 4, Some(term.clone()), 200);
        assert!(l.check(209, 4, Some(&key(1)), None).is_ok());
        assert_eq!(l.acquire(210, "B", 100, id(2)).unwrap().token, 5);
        let mut l = LeaseState::restored(10, 4, 4, Some(term.clone()), 0);
        assert_eq!(
            l.check(10, 4, Some(&key(1)), None),
            Err(Reject::Expired { current: 4 })
        );
        assert_eq!(l.acquire(10, "B", 100, id(2)).unwrap().token, 5);
        let l = LeaseState::restored(10, 4, 4, Some(term), 10_000);
        assert_eq!(l.term().unwrap().deadline_ms, 510);
    }

    #[test]
    fn admission_margin_refuses_writes_late_in_the_term() {
        let mut l = LeaseState::default();
        l.acquire(0, "A", 1000, id(1)).unwrap();
        assert!(l.check_write(899, 100, 1, None, None).is_ok());
        assert_eq!(
            l.check_write(900, 100, 1, None, None),
            Err(Reject::Expired { current: 1 })
        );
        assert!(l.check_write(999, 0, 1, None, None).is_ok());
        // Renewals are not subject to the margin.
        assert!(l.renew(950, 1, None, None, None).is_ok());
    }

    #[test]
    fn deadline_is_exclusive() {
        let mut l = LeaseState::default();
        l.acquire(100, "A", 50, id(1)).unwrap();
        assert!(l.check(149, 1, Some(&key(1)), None).is_ok());
        assert_eq!(
            l.check(150, 1, Some(&key(1)), None),
            Err(Reject::Expired { current: 1 })
        );
        assert_eq!(
            l.renew(150, 1, Some(&key(1)), None, None),
            Err(Reject::Expired { current: 1 })
        );
        // Acquire at exactly the deadline succeeds.
        assert_eq!(l.acquire(150, "B", 50, id(2)).unwrap().token, 2);
    }

    #[test]
    fn check_order_follows_the_contract() {
        let mut l = LeaseState::default();
        // Never acquired: unknown, whatever else is wrong.
        assert_eq!(
            l.check(0, 1, Some(b"x"), None),
            Err(Reject::UnknownToken { current: 0 })
        );
        l.acquire(0, "A", 10, id(1)).unwrap();
        l.release(1, 1, Some(&key(1)), None).unwrap();
        // Token 0 and a token above the current: unknown, before the lease id.
        assert_eq!(
            l.check(0, 0, Some(b"x"), None),
            Err(Reject::UnknownToken { current: 1 })
        );
        assert_eq!(
            l.check(0, 2, Some(b"x"), None),
            Err(Reject::UnknownToken { current: 1 })
        );
        // Current token, wrong id: mismatch, before released.
        assert_eq!(
            l.check(0, 1, Some(b"x"), None),
            Err(Reject::LeaseIdMismatch { current: 1 })
        );
        // Current token, right id, released (and expired): released first.
        assert_eq!(
            l.check(100, 1, Some(&key(1)), None),
            Err(Reject::Released { current: 1 })
        );
        // Without a required id, the state decides.
        assert_eq!(
            l.check(100, 1, None, None),
            Err(Reject::Released { current: 1 })
        );
        l.acquire(5, "B", 10, id(2)).unwrap();
        // Stale comes before the lease id check.
        assert_eq!(
            l.check(6, 1, Some(b"x"), None),
            Err(Reject::StaleToken { current: 2 })
        );
    }

    #[test]
    fn the_holder_is_checked_after_the_lease_id_and_before_the_state() {
        let mut l = LeaseState::default();
        l.acquire(0, "alice", 10, id(1)).unwrap();
        let not_holder = Reject::NotHolder { current: 1 };
        // Another caller with the current token: refused, even once expired.
        assert_eq!(l.check(5, 1, None, Some("bob")), Err(not_holder));
        assert_eq!(l.check(100, 1, None, Some("bob")), Err(not_holder));
        // A wrong lease id is reported first; other tokens for what they are.
        assert_eq!(
            l.check(5, 1, Some(b"x"), Some("bob")),
            Err(Reject::LeaseIdMismatch { current: 1 })
        );
        assert_eq!(
            l.check(5, 2, None, Some("bob")),
            Err(Reject::UnknownToken { current: 1 })
        );
        assert_eq!(l.renew(5, 1, None, Some("bob"), None), Err(not_holder));
        assert_eq!(l.release(5, 1, None, Some("bob")), Err(not_holder));
        assert_eq!(
            l.check(5, 1, Some(&key(1)), Some("alice")).unwrap().token,
            1
        );
        l.release(5, 1, None, Some("alice")).unwrap();
    }

    #[test]
    fn renew_with_new_ttl_and_view() {
        let mut l = LeaseState::default();
        assert_eq!(l.view(0), None);
        l.acquire(0, "A", 100, id(1)).unwrap();
        let g = l.renew(50, 1, Some(&key(1)), None, Some(1000)).unwrap();
        assert_eq!((g.ttl_ms, g.deadline_ms), (1000, 1050));
        let v = l.view(60).unwrap();
        assert_eq!(
            (v.state, v.expires_in_ms, v.ttl_ms),
            (TermState::Held, 990, 1000)
        );
        let v = l.view(1050).unwrap();
        assert_eq!((v.state, v.expires_in_ms), (TermState::Expired, 0));
        // The renewal TTL sticks for the next renewal without one... but the
        // term is expired now, so nothing moves.
        assert!(l.renew(1050, 1, Some(&key(1)), None, None).is_err());
    }

    #[test]
    fn abandoned_grant_keeps_its_token_consumed() {
        let mut l = LeaseState::default();
        l.acquire(0, "A", 10, id(1)).unwrap();
        let previous = l.term().cloned();
        let g = l.acquire(20, "B", 10, id(2)).unwrap();
        assert!(l.abandon(g.token, previous));
        assert_eq!(l.term().unwrap().token, 1);
        assert_eq!(l.view(20).unwrap().transitions, 1);
        // Token 2 was never returned; the next grant skips it anyway.
        assert_eq!(l.acquire(20, "C", 10, id(3)).unwrap().token, 3);
        // Token 2 now sits below the current token, so it reads as stale.
        assert_eq!(
            l.check(21, 2, None, None),
            Err(Reject::StaleToken { current: 3 })
        );
    }

    #[test]
    fn saturating_deadline_and_token_exhaustion() {
        let mut l = LeaseState {
            last_token: u64::MAX - 1,
            ..LeaseState::default()
        };
        let g = l.acquire(u64::MAX - 5, "A", 3_600_000, id(1)).unwrap();
        assert_eq!((g.token, g.deadline_ms), (u64::MAX, u64::MAX));
        l.release(u64::MAX - 4, u64::MAX, Some(&key(1)), None)
            .unwrap();
        assert_eq!(
            l.acquire(u64::MAX - 3, "B", 10, id(2)),
            Err(AcquireRefused::TokensExhausted)
        );
    }
}
