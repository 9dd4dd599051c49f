//! Leases: the concurrent handle the rest of the proxy shares ([`store`])
//! and, in cluster mode, the member's right to admit ([`primacy`]), around
//! the core's decisions (from `fencegate-core`, re-exported here): the
//! state machine ([`machine`]), lease ids ([`id`]), writes in flight by
//! term ([`inflight`]), the admission decision ([`admission`]), the
//! restart rule ([`restart`]), when a lease may be forgotten
//! ([`retention`]), and one lease with every procedure on it ([`slot`]),
//! which the store calls under the lease's lock.

pub use fencegate_core::lease::{admission, id, inflight, machine, restart, retention, slot};
pub mod primacy;
pub mod store;

pub use id::LeaseId;
pub use machine::{Admit, Grant, Held, LeaseState, Reject, TermState, View};
pub use primacy::Primacy;
pub use restart::RestartRule;
pub use store::{
    AcquireError, Acquired, Admission, AdmitError, AdmitOptions, Admitted, LeaseLimits, LeaseStore,
    RenewError, Requester, WriteGuard,
};
