//! Leases: the pure state machine ([`machine`]), lease ids ([`id`]), writes in
//! flight by term ([`inflight`]) and the concurrent handle the rest of the
//! proxy shares ([`store`]).

pub mod id;
pub mod inflight;
pub mod machine;
pub mod store;

pub use id::LeaseId;
pub use machine::{Admit, Grant, Held, LeaseState, Reject, TermState, View};
pub use store::{
    AcquireError, Acquired, AdmitError, AdmitOptions, Admitted, LeaseLimits, LeaseStore,
    RenewError, RestartRule, WriteGuard,
};

/// Longest lease name, in bytes.
pub const MAX_LEASE_NAME_LEN: usize = 128;

/// Whether `name` is a valid lease name: 1-128 bytes of `[A-Za-z0-9._-]`.
pub fn is_valid_lease_name(name: &str) -> bool {
    (1..=MAX_LEASE_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names() {
        for ok in ["a", "orders", "A.b_c-9", &"x".repeat(128)] {
            assert!(is_valid_lease_name(ok), "{ok}");
        }
        for bad in ["", "a/b", "a b", "ü", "a%2f", &"x".repeat(129), "a\0"] {
            assert!(!is_valid_lease_name(bad), "{bad:?}");
        }
    }
}
