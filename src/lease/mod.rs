//! Leases: the pure state machine ([`machine`]), lease ids ([`id`]), writes in
//! flight by term ([`inflight`]), the concurrent handle the rest of the
//! proxy shares ([`store`]) and, in cluster mode, the member's right to
//! admit ([`primacy`]).

pub mod inflight;

pub use fencegate_core::lease::{id, machine};
pub mod primacy;
pub mod store;

pub use id::LeaseId;
pub use machine::{Admit, Grant, Held, LeaseState, Reject, TermState, View};
pub use primacy::Primacy;
pub use store::{
    AcquireError, Acquired, Admission, AdmitError, AdmitOptions, Admitted, LeaseLimits, LeaseStore,
    RenewError, Requester, RestartRule, WriteGuard,
};
