//! Leases: the pure state machine ([`machine`]), lease ids ([`id`]), writes
//! in flight by term ([`inflight`]), the admission decision with the
//! handover barrier ([`admission`]), the restart rule ([`restart`]) and
//! when a lease may be forgotten ([`retention`]); and one lease as the
//! store keeps it, with every procedure on it ([`slot`]), which the lease
//! store and the simulator both drive.

pub mod admission;
pub mod id;
pub mod inflight;
pub mod machine;
pub mod restart;
pub mod retention;
pub mod slot;
