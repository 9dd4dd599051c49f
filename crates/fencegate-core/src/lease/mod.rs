//! Leases: the pure state machine ([`machine`]), lease ids ([`id`]), writes
//! in flight by term ([`inflight`]), the admission decision with the
//! handover barrier ([`admission`]), the restart rule ([`restart`]) and
//! when a lease may be forgotten ([`retention`]).

pub mod admission;
pub mod id;
pub mod inflight;
pub mod machine;
pub mod restart;
pub mod retention;
