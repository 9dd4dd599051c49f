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
    AcquireError, Acquired, Admission, AdmitError, AdmitOptions, Admitted, LeaseLimits, LeaseStore,
    RenewError, RestartRule, WriteGuard,
};
