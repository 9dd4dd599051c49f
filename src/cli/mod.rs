//! The client commands: `fencegate loadtest` (and, as they arrive, the lease
//! client and `fencegate run`).

pub mod loadtest;
