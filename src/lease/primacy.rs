//! A cluster member's right to admit: until when, on the proxy's own clock,
//! its primacy is confirmed.
//!
//! The member that holds primacy moves the deadline forward each time etcd
//! confirms its election lease (the send time of the confirmed keepalive
//! plus the TTL etcd granted, minus a margin), so the deadline passes before
//! etcd can let another member win. Once revoked, a `Primacy` stays revoked:
//! the next term of primacy gets a new one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::clock::Clock;

/// Until when this member may admit writes and grants.
#[derive(Debug)]
pub struct Primacy {
    clock: Clock,
    until_ms: AtomicU64,
    revoked: AtomicBool,
    /// Test-only: whether the deadline is enforced (self-fencing). Off, only
    /// an explicit revocation stops admission.
    enforce: bool,
}

impl Primacy {
    /// Primacy confirmed until `until_ms` on `clock`.
    pub fn new(clock: Clock, until_ms: u64, enforce: bool) -> Self {
        Self {
            clock,
            until_ms: AtomicU64::new(until_ms),
            revoked: AtomicBool::new(false),
            enforce,
        }
    }

    /// Whether this member may admit now.
    pub fn is_live(&self) -> bool {
        // Sequentially consistent with the revocation and the count of
        // writes in flight (see `InflightCount::add`).
        let revoked = self.revoked.load(Ordering::SeqCst);
        let until_ms = self.until_ms.load(Ordering::Acquire);
        fencegate_core::cluster::primacy_admits(
            self.clock.now_ms(),
            until_ms,
            revoked,
            self.enforce,
        )
    }

    /// Primacy was confirmed again, until `until_ms` (the core's
    /// `primacy_confirmed`: never moves back).
    pub fn confirm_until(&self, until_ms: u64) {
        let _ = self
            .until_ms
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(fencegate_core::cluster::primacy_confirmed(held, until_ms))
            });
    }

    /// Primacy is lost for good.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Whether [`Primacy::revoke`] was called (a deadline that passed does
    /// not revoke: a late confirmation may still come).
    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_until_the_deadline_then_never_after_revocation() {
        let clock = Clock::manual(0);
        let p = Primacy::new(clock.clone(), 100, true);
        assert!(p.is_live());
        clock.advance(100);
        assert!(!p.is_live());
        p.confirm_until(150);
        assert!(p.is_live());
        // Never moves back.
        p.confirm_until(120);
        clock.advance(30);
        assert!(p.is_live());
        p.revoke();
        p.confirm_until(1000);
        assert!(!p.is_live());
    }

    #[test]
    fn without_self_fencing_only_revocation_stops_it() {
        let clock = Clock::manual(0);
        let p = Primacy::new(clock.clone(), 100, false);
        clock.advance(1000);
        assert!(p.is_live());
        p.revoke();
        assert!(!p.is_live());
    }
}
