//! Leases: the pure state machine ([`machine`]) and lease ids ([`id`]).

pub mod id;
pub mod machine;
